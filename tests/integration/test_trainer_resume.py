"""Kill the trainer service with SIGKILL mid-run and restart it with `--resume auto`: it continues from
the checkpoint's version, and every trajectory after the checkpoint's stream sequence is trained on
exactly once (checked by prompt ids in the step record)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from services.common.bus import connect
from services.common.logging import get_logger
from tests.support.trainer import SERVICE_RUN as RUN
from tests.support.trainer import kill_group as _kill
from tests.support.trainer import make_group, publish_group, read_steps
from tests.support.trainer import start_trainer as _start
from tests.support.trainer import wait_for_step as _wait_for

log = get_logger("test")


@pytest.mark.timeout(300)
async def test_sigkill_then_resume_trains_each_trajectory_after_the_checkpoint_once(
    nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "trainer"
    out.mkdir()
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    from services.common.bus import declare_streams

    await declare_streams(js)
    seqs: dict[str, int] = {}

    async def publish(first: int, n: int) -> None:
        for i in range(first, first + n):
            pid = f"p{i}"
            seqs[pid] = await publish_group(js, RUN, pid, make_group(tiny_model, f"{i:03d}", seed=i))

    await publish(0, 6)
    first = _start(nats_url, tiny_model, out)
    try:
        # 6 groups = 3 steps; the checkpoint is at version 2; kill after step 3 was trained
        _wait_for(lambda: any(r.get("version") == 3 and "prompt_ids" in r for r in read_steps(out)), 180, first)
    finally:
        _kill(first)
    ckpt = [r for r in read_steps(out) if r.get("event") == "checkpoint"]
    assert [r["version"] for r in ckpt] == [2]
    ckpt_seq = ckpt[-1]["last_seq"]

    await publish(6, 6)
    second = _start(nats_url, tiny_model, out, "--resume", "auto")
    try:
        assert second.wait(timeout=180) == 0
    finally:
        _kill(second)
    await nc.close()

    rows = read_steps(out)
    starts = [i for i, r in enumerate(rows) if r.get("event") == "start"]
    assert len(starts) == 2
    resumed = rows[starts[1]]
    assert resumed["resumed"] and resumed["version"] == 2 and resumed["last_seq"] == ckpt_seq
    after = [r for r in rows[starts[1]:] if "prompt_ids" in r]
    assert [r["version"] for r in after] == [3, 4, 5, 6]
    trained = Counter(pid for r in after for pid in r["prompt_ids"])
    expected = {pid for pid, seq in seqs.items() if seq > ckpt_seq}
    assert set(trained) == expected and all(n == 1 for n in trained.values())
    # the step trained before the kill (version 3) was not counted: it is trained again from the checkpoint
    before = [r for r in rows[: starts[1]] if r.get("version") == 3 and "prompt_ids" in r]
    assert set(before[0]["prompt_ids"]) <= expected
