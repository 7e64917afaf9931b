"""`jetrl status` shows what went wrong in the rollout workers, as `jetrl up`'s display counts it: a
real rollout worker against a real nats-server runs a workflow whose episodes fail for one prompt
(KeyError, rejected after its one delivery) and return None once for another (its group shrinks);
`jetrl status`, run as a process, reports the failed episodes by exception type, the rejected prompt
and the shrunk group from the worker's METRICS events."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import nats
import pytest

from schemas.messages import PromptTask, encode
from schemas.subjects import TRAJECTORIES_STREAM
from services.common.bus import declare_streams
from services.common.metrics import MetricsPublisher
from services.rollout.tensors import sample_tensors
from services.rollout.workflow import GroupedRolloutWorkflow, RolloutWorkflow
from tests.support.rollout import RUN, S, running_worker

ROOT = Path(__file__).resolve().parents[2]


class Flaky(RolloutWorkflow):
    """By the row's `kind`: "fail" raises KeyError on every episode; "half" returns None from its
    first episode only; anything else gives a sample."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        if data["kind"] == "fail":
            raise KeyError("prompt_ids")
        self.calls[data["id"]] += 1
        if data["kind"] == "half" and self.calls[data["id"]] == 1:
            return None
        return sample_tensors([1, 2], [3, 4], [-0.5, -0.5], [0, 0], reward=1.0)


def jetrl_status(nats_url: str, fmt: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "services.status", f"run={RUN}", f"nats_url={nats_url}", f"format={fmt}", "log_format=json"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.timeout(180)
async def test_status_counts_failed_episodes_by_type_rejections_and_shrunk_groups(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await declare_streams(js)
        results = await js.subscribe(S.trajectories, stream=TRAJECTORIES_STREAM)
        async with running_worker(nc, RUN, GroupedRolloutWorkflow(Flaky(), 2), None, max_deliver=1, nak_delay_s=0.1) as w:
            w.metrics = MetricsPublisher(nc, RUN, "rollout", "w")  # as `jetrl rollout` wires it (service.py)
            stop = asyncio.Event()
            reporting = asyncio.create_task(w.metrics_loop(stop, 0.5))
            for pid, kind in (("ok", "ok"), ("bad", "fail"), ("half", "half")):
                task = PromptTask(run=RUN, prompt_id=pid, data={"id": pid, "kind": kind})
                await js.publish(S.prompts_train, encode(task), headers={"Nats-Msg-Id": f"{RUN}/prompt/{pid}"})
            got = [await results.next_msg(timeout=60) for _ in range(3)]  # two groups and a rejection
            assert sorted(m.headers["Jetrl-Prompt-Id"] for m in got) == ["bad", "half", "ok"]
            stop.set()
            await reporting  # its last event, sent as it stops, carries the totals
        mine = w._snapshot()  # the worker's own totals
    finally:
        await nc.close()
    failed = int(mine["episodes_failed_total"])
    assert failed >= 1 and mine["rejected_total"] == 1 and mine["groups_shrunk_total"] == 1, mine
    text = jetrl_status(nats_url, "table")
    assert f"1 worker(s): episodes failed {failed} (KeyError {failed}) rejected 1 groups shrunk 1" in text, text
    outcomes = json.loads(jetrl_status(nats_url, "json"))["rollout"]["outcomes"]
    assert outcomes["failed_by_KeyError"] == failed and outcomes["rejected_total"] == 1
    assert outcomes["groups_shrunk_total"] == 1
