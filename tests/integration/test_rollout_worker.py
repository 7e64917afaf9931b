"""The rollout worker loop against a real nats-server, in the test's event loop, with workflows that
need no model: delivery, retries, rejections, poison prompts, eval routing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import nats
import pytest

from schemas.headers import is_rejection
from schemas.messages import MetricsEvent, PromptTask, RejectionMarker, decode
from schemas.subjects import METRICS_STREAM, PROMPTS_STREAM
from schemas.trajectory import decode_group
from services.common.bus import declare_streams
from services.common.metrics import MetricsPublisher
from services.rollout.engine import BadRequestError
from services.rollout.worker import RolloutWorker
from services.rollout.worker_config import WorkerConfig
from services.rollout.workflow import RolloutWorkflow, workflow_context
from services.rollout.workflows.synthetic import SyntheticWorkflow
from tests.support.rollout import RUN, S, collect, push_prompts


class CountingWorkflow(SyntheticWorkflow):
    """Counts episode starts per task id, and records what `workflow_context` said."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.starts: dict[str, int] = {}
        self.scopes: dict[str, str] = {}

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        task_id = workflow_context.prompt_id or "?"
        self.starts[task_id] = self.starts.get(task_id, 0) + 1
        self.scopes[task_id] = workflow_context.stat_scope()
        return await super().arun_episode(engine, data)


@contextlib.asynccontextmanager
async def workers(url: str, workflow: RolloutWorkflow, count: int, **config: Any) -> AsyncIterator[list[RolloutWorker]]:
    conns = [await nats.connect(url) for _ in range(count)]
    stopping = asyncio.Event()
    made = [
        RolloutWorker(
            nc,
            RUN,
            workflow,
            None,
            WorkerConfig(**{"worker": f"w{i}", "fetch_timeout_s": 0.2, **config}),
            metrics=MetricsPublisher(nc, RUN, "rollout", f"w{i}"),
        )
        for i, nc in enumerate(conns)
    ]
    for w in made:  # declare first, so prompts pushed next have a consumer
        await w.declare()
    tasks = [asyncio.create_task(w.run(stopping)) for w in made]
    try:
        yield made
    finally:
        stopping.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
        for nc in conns:
            await nc.close()


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[Any]:
    nc = await nats.connect(nats_url)
    await declare_streams(nc.jetstream())
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


async def test_n_prompts_through_three_workers_give_exactly_n_results(nats_url: str, js: Any) -> None:
    wf = CountingWorkflow(group_size=3, delay_s=0.02)
    async with workers(nats_url, wf, 3, max_concurrent=2, ack_wait_s=5.0) as ws:
        ids = await push_prompts(js, 18)
        msgs = await collect(js, S.trajectories, 18)
    got = sorted(m.headers["Jetrl-Prompt-Id"] for m in msgs)
    assert got == sorted(ids)
    assert all(n == 1 for n in wf.starts.values()) and len(wf.starts) == 18  # each prompt ran once
    groups = [decode_group(m.data) for m in msgs]
    assert all(g.tensors["input_ids"].shape[0] == 3 for g in groups)
    assert {g.meta.worker for g in groups} <= {"w0", "w1", "w2"}
    assert len({g.meta.worker for g in groups}) >= 2  # the work was shared
    assert sum(w.stats.accepted for w in ws) == 18
    assert (await js.stream_info(PROMPTS_STREAM)).state.messages == 0  # every prompt acked


async def test_always_raising_workflow_ends_as_rejections_after_max_deliver(nats_url: str, js: Any) -> None:
    wf = CountingWorkflow(fail="always")
    async with workers(nats_url, wf, 2, max_deliver=3, nak_delay_s=0.05, ack_wait_s=5.0):
        ids = await push_prompts(js, 4)
        msgs = await collect(js, S.trajectories, 4)
    assert sorted(m.headers["Jetrl-Prompt-Id"] for m in msgs) == sorted(ids)
    assert all(is_rejection(m.headers) for m in msgs)
    reasons = [decode(RejectionMarker, m.data).reason for m in msgs]
    assert all("EpisodeFailed" in r and "attempt 3 of 3" in r for r in reasons), reasons
    assert wf.starts == {pid: 3 for pid in ids}


async def test_rejected_episode_publishes_a_marker(nats_url: str, js: Any) -> None:
    async with workers(nats_url, CountingWorkflow(reject=True), 1):
        await push_prompts(js, 2)
        msgs = await collect(js, S.trajectories, 2)
    assert len(msgs) == 2 and all(is_rejection(m.headers) for m in msgs)
    assert "rejected by the workflow" in decode(RejectionMarker, msgs[0].data).reason


async def test_poison_prompt_is_terminated_counted_and_the_worker_goes_on(nats_url: str, js: Any) -> None:
    metrics_sub = await js.subscribe(S.metrics("rollout"), stream=METRICS_STREAM)
    async with workers(nats_url, CountingWorkflow(group_size=1), 1) as ws:
        await js.publish(S.prompts_train, b"\xc1 not msgpack")
        await push_prompts(js, 1)
        msgs = await collect(js, S.trajectories, 1)
        await ws[0].metrics.emit(ws[0].stats.snapshot())
        event = decode(MetricsEvent, (await metrics_sub.next_msg(timeout=5)).data)
    assert len(msgs) == 1 and not is_rejection(msgs[0].headers)
    assert event.values["malformed_messages"] == 1
    assert event.values["accepted_total"] == 1 and event.values["in_flight"] == 0
    assert event.values["episodes_per_s"] > 0 and event.values["tokens_per_s"] > 0 and event.values["rejection_rate"] == 0
    assert event.values["episode_latency_s_max"] >= event.values["episode_latency_s_mean"] > 0
    assert (await js.stream_info(PROMPTS_STREAM)).state.messages == 0  # the poison is gone, not retried


async def test_eval_prompts_run_as_eval_and_land_on_their_own_subject(nats_url: str, js: Any) -> None:
    wf = CountingWorkflow(group_size=2)
    async with workers(nats_url, wf, 1):
        await push_prompts(js, 2, subject=S.prompts_eval, prefix="e")
        await push_prompts(js, 1)
        evals = await collect(js, S.trajectories_eval, 2)
        train = await collect(js, S.trajectories, 1)
    assert sorted(m.headers["Jetrl-Prompt-Id"] for m in evals) == ["e0", "e1"]
    assert all(decode_group(m.data).meta.is_eval for m in evals)
    assert [m.headers["Jetrl-Prompt-Id"] for m in train] == ["p0"]  # the trainer's subject has no eval result
    assert wf.scopes == {"e0": "eval-rollout", "e1": "eval-rollout", "p0": "rollout"}


async def test_result_of_a_redelivered_prompt_is_not_recorded_twice(nats_url: str, js: Any) -> None:
    # a worker that died between publishing p0's result and acking p0 left this behind
    from schemas.headers import trajectory_headers
    from schemas.trajectory import TrajectoryMeta, encode_group

    group = await SyntheticWorkflow(group_size=1).arun_episode(None, {"prompt": "000="})
    meta = TrajectoryMeta(run=RUN, prompt_id="p0", worker="dead", head_version=0, tail_version=0)
    await js.publish(S.trajectories, encode_group(group, run=RUN, prompt_id="p0", worker="dead"), headers=trajectory_headers(meta))
    async with workers(nats_url, CountingWorkflow(group_size=1), 1) as ws:
        await push_prompts(js, 2)  # p0 comes round again, as a redelivery would bring it
        msgs = await collect(js, S.trajectories, 3, timeout_s=1.5)  # a third would be the duplicate
    assert sorted(m.headers["Jetrl-Prompt-Id"] for m in msgs) == ["p0", "p1"]
    assert decode_group(msgs[0].data).meta.worker == "dead"  # the first record stands
    assert ws[0].stats.accepted == 2 and (await js.stream_info(PROMPTS_STREAM)).state.messages == 0


async def test_stopping_mid_episode_hands_prompts_straight_back(nats_url: str, js: Any) -> None:
    slow = CountingWorkflow(group_size=1, delay_s=60)
    nc = await nats.connect(nats_url)
    first = RolloutWorker(
        nc,
        RUN,
        slow,
        None,
        WorkerConfig(worker="slow", max_concurrent=2, ack_wait_s=30, drain_timeout_s=0.1, fetch_timeout_s=0.2),
    )
    await first.declare()
    stopping = asyncio.Event()
    task = asyncio.create_task(first.run(stopping))
    try:
        await push_prompts(js, 2)
        deadline = asyncio.get_running_loop().time() + 10
        while first.stats.in_flight < 2:
            assert asyncio.get_running_loop().time() < deadline, "the worker never started both episodes"
            await asyncio.sleep(0.02)
        stopping.set()
        await asyncio.wait_for(task, 5)  # drained within drain_timeout_s, not after the 60 s episodes
    finally:
        await nc.close()
    # nak'ed at once: another worker gets them now, long before ack_wait (30 s) would expire
    async with workers(nats_url, CountingWorkflow(group_size=1), 1, ack_wait_s=30):
        msgs = await collect(js, S.trajectories, 2, timeout_s=10)
    assert sorted(m.headers["Jetrl-Prompt-Id"] for m in msgs) == ["p0", "p1"]
    assert {decode_group(m.data).meta.worker for m in msgs} == {"w0"}


async def test_malformed_prompt_with_a_feeder_msg_id_is_answered_with_a_rejection(nats_url: str, js: Any) -> None:
    # The feeder counts a prompt in flight until its result arrives: a poison prompt must still get one.
    async with workers(nats_url, CountingWorkflow(group_size=1), 1) as ws:
        await js.publish(S.prompts_train, b"\xc1 not msgpack", headers={"Nats-Msg-Id": f"{RUN}/prompt/bad0"})
        future = PromptTask(run=RUN, prompt_id="bad1", data={}).model_dump() | {"schema_version": 99}
        await js.publish(S.prompts_eval, msgpack.packb(future), headers={"Nats-Msg-Id": f"{RUN}/prompt/bad1"})
        await js.publish(S.prompts_train, b"\xc1 no header either")  # no id to answer for: terminated only
        train = await collect(js, S.trajectories, 1)
        evals = await collect(js, S.trajectories_eval, 1)
        assert ws[0].metrics is not None and ws[0].metrics.counters["malformed_messages"] == 3
    assert [m.headers["Jetrl-Prompt-Id"] for m in train] == ["bad0"] and is_rejection(train[0].headers)
    assert [m.headers["Jetrl-Prompt-Id"] for m in evals] == ["bad1"] and is_rejection(evals[0].headers)
    assert "not msgpack" in decode(RejectionMarker, train[0].data).reason
    marker = decode(RejectionMarker, evals[0].data)
    assert "schema_version 99" in marker.reason and marker.is_eval and marker.worker == "w0"
    assert (await js.stream_info(PROMPTS_STREAM)).state.messages == 0  # terminated, not retried


class HangingWorkflow(RolloutWorkflow):
    """A custom workflow that never returns (a stuck tool call, a lost reply)."""

    def __init__(self) -> None:
        self.starts = 0

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        self.starts += 1
        await asyncio.Event().wait()


async def test_a_hanging_episode_times_out_is_retried_and_then_rejected(nats_url: str, js: Any) -> None:
    wf = HangingWorkflow()
    async with workers(nats_url, wf, 1, max_concurrent=1, episode_timeout_s=0.3, max_deliver=2, nak_delay_s=0.05) as ws:
        await push_prompts(js, 2)
        msgs = await collect(js, S.trajectories, 2)
        assert ws[0].stats.in_flight == 0  # the concurrency slot came back each time
    assert sorted(m.headers["Jetrl-Prompt-Id"] for m in msgs) == ["p0", "p1"]
    assert all(is_rejection(m.headers) for m in msgs)
    reasons = [decode(RejectionMarker, m.data).reason for m in msgs]
    assert all("EpisodeTimeout" in r and "episode_timeout_s=0.3" in r and "attempt 2 of 2" in r for r in reasons), reasons
    assert wf.starts == 4  # two attempts per prompt, one slot: nothing was stuck


class BadRequestWorkflow(CountingWorkflow):
    """A custom workflow that lets the inference client's 400 propagate as it is."""

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        await super().arun_episode(engine, data)
        raise BadRequestError("http://server/generate: HTTP 400: input id 100000 is out of the vocab")


async def test_an_inference_400_from_a_custom_workflow_is_rejected_without_retries(nats_url: str, js: Any) -> None:
    wf = BadRequestWorkflow(group_size=1)
    async with workers(nats_url, wf, 1, max_deliver=3, nak_delay_s=0.05):
        await push_prompts(js, 2)
        msgs = await collect(js, S.trajectories, 2)
    assert all(is_rejection(m.headers) for m in msgs) and len(msgs) == 2
    reasons = [decode(RejectionMarker, m.data).reason for m in msgs]
    assert all("BadRequestError" in r and "vocab" in r and "attempt 1 of 3" in r for r in reasons), reasons
    assert wf.starts == {"p0": 1, "p1": 1}
