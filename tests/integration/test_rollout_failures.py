"""No failing episode goes unseen: a worker whose every episode fails stops with the error, a tensor
dict of the wrong shape is a WorkflowError naming the key and is not retried, a group that shrinks
because episodes returned None is counted, and failures are counted by exception type on METRICS and
logged with their traceback and the workflow's name (once per kind in a while, not once per episode)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
import torch
from structlog.testing import capture_logs

from schemas.headers import is_rejection
from schemas.messages import RejectionMarker, decode
from schemas.trajectory import decode_group
from services.common.bus import declare_streams
from services.common.metrics import MetricsPublisher
from services.rollout.failures import EpisodeFailures, EpisodesFailing
from services.rollout.tensors import sample_tensors
from services.rollout.versions import CheckedWorkflow
from services.rollout.worker import RolloutWorker
from services.rollout.worker_config import WorkerConfig
from services.rollout.workflow import GroupedRolloutWorkflow, RolloutWorkflow, WorkflowError, as_tensor_dict
from tests.support.rollout import RUN, S, collect, push_prompts


class MissingKeyWorkflow(RolloutWorkflow):
    """Fails every episode as a researcher's first try often does."""

    def __init__(self) -> None:
        self.starts = 0

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        self.starts += 1
        return {"x": data["prompt_ids"]}


class FlatWorkflow(RolloutWorkflow):
    """Returns `[seq]` tensors where the contract wants `[1, seq]`."""

    def __init__(self) -> None:
        self.starts = 0

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        self.starts += 1
        one = sample_tensors([1, 2], [3, 4, 5], [-0.1] * 3, [0] * 3, 1.0)
        return {k: v[0] for k, v in one.items()}


class SometimesNoneWorkflow(RolloutWorkflow):
    """Every other episode returns None (AReaL's way of dropping a sample)."""

    def __init__(self) -> None:
        self.n = 0

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        self.n += 1
        if self.n % 2:
            return None
        return sample_tensors([1, 2], [3, 4], [-0.1, -0.2], [0, 0], 1.0)


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Any]:
    conn = await nats.connect(nats_url)
    await declare_streams(conn.jetstream())
    try:
        yield conn
    finally:
        await conn.close()


def worker(nc: Any, workflow: RolloutWorkflow, **config: Any) -> RolloutWorker:
    cfg = WorkerConfig(**{"worker": "w0", "fetch_timeout_s": 0.2, "nak_delay_s": 0.05, **config})
    return RolloutWorker(nc, RUN, workflow, None, cfg, metrics=MetricsPublisher(nc, RUN, "rollout", "w0"))


def test_a_flat_tensor_is_a_workflow_error_naming_key_and_shapes() -> None:
    one = sample_tensors([1, 2], [3, 4, 5], [-0.1] * 3, [0] * 3, 1.0)
    with pytest.raises(WorkflowError, match=r"attention_mask has shape \[5\], expected \[batch, seq\] \(e\.g\. \[1, 5\]"):
        as_tensor_dict({k: v[0] for k, v in one.items()})
    with pytest.raises(WorkflowError, match=r"loss_mask has shape \[1, 4\], expected \[batch, seq\] = \[1, 5\]"):
        as_tensor_dict({**one, "loss_mask": torch.ones(1, 4)})
    with pytest.raises(WorkflowError, match=r"rewards has shape \[\], expected \[batch\] = \[1\]"):
        as_tensor_dict({**one, "rewards": torch.tensor(1.0)})


async def test_a_bad_shape_is_rejected_on_the_first_attempt_naming_the_key(nc: Any) -> None:
    js = nc.jetstream()
    wf = FlatWorkflow()
    w = worker(nc, GroupedRolloutWorkflow(CheckedWorkflow(wf), 2), max_deliver=3)
    await w.declare()
    stopping = asyncio.Event()
    task = asyncio.create_task(w.run(stopping))
    await push_prompts(js, 2)
    msgs = await collect(js, S.trajectories, 2)
    stopping.set()
    await task
    reasons = [decode(RejectionMarker, m.data).reason for m in msgs]
    assert all(is_rejection(m.headers) for m in msgs) and len(msgs) == 2
    assert all("WorkflowError" in r and "attention_mask has shape [5], expected [batch, seq]" in r and "attempt 1 of 3" in r
               for r in reasons), reasons
    assert wf.starts == 4  # two prompts, two episodes each, never retried


async def test_a_worker_whose_every_episode_fails_stops_with_the_error(nc: Any) -> None:
    js = nc.jetstream()
    wf = MissingKeyWorkflow()
    w = worker(nc, CheckedWorkflow(wf), max_deliver=2, fail_fast_after=6, max_concurrent=2)
    await w.declare()
    await push_prompts(js, 20)
    with capture_logs() as logs:
        with pytest.raises(EpisodesFailing, match=r"tests\.integration\.test_rollout_failures\.MissingKeyWorkflow.*"
                                                  r"'KeyError': \d+.*the last: KeyError: 'prompt_ids'") as raised:
            await asyncio.wait_for(w.run(asyncio.Event()), 30)
    assert isinstance(raised.value.__cause__, KeyError)
    assert 6 <= wf.starts <= 8  # stopped at the bound (plus what was already running), not after 20 prompts x 2
    counters = w.failures.counters()
    assert counters["failed_by_KeyError"] == counters["episodes_failed_total"] >= 6
    failed = [e for e in logs if e["event"].startswith("episode failed")]
    # one log line with the traceback and the workflow's name; the others counted, not logged
    assert len(failed) == 1 and failed[0]["exc_info"] is not None and "MissingKeyWorkflow" in failed[0]["workflow"]


async def test_a_group_shrunk_by_none_is_counted_and_trains_what_is_left(nc: Any) -> None:
    js = nc.jetstream()
    w = worker(nc, GroupedRolloutWorkflow(CheckedWorkflow(SometimesNoneWorkflow()), 4))
    await w.declare()
    stopping = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(w.run(stopping))
        await push_prompts(js, 1)
        [msg] = await collect(js, S.trajectories, 1)
        stopping.set()
        await task
    assert decode_group(msg.data).tensors["input_ids"].shape[0] == 2
    assert w.failures.counters()["groups_shrunk_total"] == 1
    [warned] = [e for e in logs if e["event"].startswith("episodes returned None")]
    assert (warned["kept"], warned["group_size"]) == (2, 4) and "SometimesNoneWorkflow" in warned["workflow"]


def test_failures_are_logged_once_per_kind_in_a_while_and_all_counted() -> None:
    book = EpisodeFailures("my.Workflow", log_every_s=3600)
    with capture_logs() as logs:
        for i in range(5):
            book.failed(KeyError("a"), prompt_id=f"p{i}", attempt=1, final=False)
        book.failed(TypeError("b"), prompt_id="p9", attempt=1, final=True)
    assert [(e["event"], e["error"]) for e in logs] == [
        ("episode failed; retrying later", "KeyError: 'a'"), ("episode failed; prompt rejected", "TypeError: b")]
    assert book.counters() == {"failed_by_KeyError": 5.0, "failed_by_TypeError": 1.0,
                               "episodes_failed_total": 6.0, "groups_shrunk_total": 0.0, "groups_not_accepted_total": 0.0}
