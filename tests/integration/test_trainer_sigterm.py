"""SIGTERM to `python -m services.trainer` (1 rank): it stops waiting for trajectories, checkpoints the
version it reached, exits 0 within its shutdown deadline, and `--resume auto` continues from there."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from services.common.bus import connect, declare_streams
from services.trainer.model import checkpoint as ckpt
from tests.support.trainer import SERVICE_RUN as RUN
from tests.support.trainer import kill_group as _kill
from tests.support.trainer import make_group, publish_group, read_steps, trained_steps
from tests.support.trainer import start_trainer as _start
from tests.support.trainer import wait_for_step as _wait_for

SHUTDOWN_S = 10.0
# Only SIGTERM and the end of the run write checkpoints; the feeder is off, trajectories come from the test.
ARGS = ("checkpoint_every=0", f"shutdown_timeout_s={SHUTDOWN_S}")


@pytest.mark.timeout(120)
async def test_sigterm_checkpoints_the_current_version_and_exits_0(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "trainer"
    out.mkdir()
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await declare_streams(js)
    for i in range(4):  # 2 steps of 2 groups; then the trainer waits for more
        await publish_group(js, RUN, f"p{i}", make_group(tiny_model, f"{i:03d}", seed=i))

    proc = _start(nats_url, tiny_model, out, *ARGS, "total_steps=0")
    try:
        _wait_for(lambda: any(r["version"] == 2 for r in trained_steps(out)), 90, proc)
        assert not [r for r in read_steps(out) if r.get("event") == "checkpoint"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=SHUTDOWN_S) == 0  # TimeoutExpired: it overran its shutdown deadline
    finally:
        _kill(proc)

    root = ckpt.checkpoint_root(out)
    assert ckpt.latest(root) == ckpt.tag_for(2), "the SIGTERM checkpoint holds the version reached"
    assert [r["version"] for r in read_steps(out) if r.get("event") == "checkpoint"] == [2]

    # --resume auto picks it up: version 2, and only the new trajectories are trained
    for i in range(4, 6):
        await publish_group(js, RUN, f"p{i}", make_group(tiny_model, f"{i:03d}", seed=i))
    await nc.close()
    again = _start(nats_url, tiny_model, out, *ARGS, "total_steps=3", "--resume", "auto")
    try:
        assert again.wait(timeout=90) == 0
    finally:
        _kill(again)
    rows = read_steps(out)
    start = [r for r in rows if r.get("event") == "start"][-1]
    assert start["resumed"] and start["version"] == 2
    last = trained_steps(out)[-1]
    assert last["version"] == 3 and sorted(last["prompt_ids"]) == ["p4", "p5"]
    assert ckpt.latest(root) == ckpt.tag_for(3)
    assert os.path.isdir(root / ckpt.tag_for(3))
