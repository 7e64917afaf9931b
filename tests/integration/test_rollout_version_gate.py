"""Version gating with a real simulated inference server and a real nats-server: a prompt whose
`min_version` the server does not hold yet is held by the rollout worker, in progress (not redelivered,
however long it waits), while other prompts go on; once the server loads that version and reports it
on `weights.loaded`, the episode runs and its group carries the new version."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import nats.js.errors
import numpy as np
import pytest

from schemas.messages import PromptTask, WeightsLoaded, decode, encode
from schemas.subjects import PROMPTS_STREAM, Subjects
from schemas.trajectory import decode_group
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import ModelRequest, SGLangClient
from services.rollout.worker import RolloutWorker
from services.rollout.worker_config import WorkerConfig
from services.rollout.workflow import RolloutWorkflow
from tests.support.inference import spawn_server, wait_ready
from tests.support.rollout import RUN, collect

S = Subjects(RUN)
ACK_WAIT_S = 1.0


class OneSample(RolloutWorkflow):
    """One generated sample per prompt: enough to see which weight version produced it."""

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        prompt = [1, 5, 6]
        out = await engine.agenerate(ModelRequest(input_ids=prompt, max_new_tokens=4))
        n = len(out.output_ids)
        ids = np.array([prompt + out.output_ids], dtype=np.int64)
        loss_mask = np.array([[0] * len(prompt) + [1] * n], dtype=np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": loss_mask,
                "logprobs": np.array([[0.0] * len(prompt) + out.output_logprobs], dtype=np.float32),
                "rewards": np.array([1.0], dtype=np.float32),
                "versions": np.array([[-1] * len(prompt) + out.output_versions], dtype=np.int64)}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    proc = wait_ready(spawn_server(None, tmp_path, "simulate=true", "sim.token_latency_s=0.001", "sim.median_new_tokens=3"))
    try:
        yield proc.url
    finally:
        proc.stop()


async def publish(js: Any, pid: str, min_version: int) -> None:
    task = PromptTask(run=RUN, prompt_id=pid, data={"id": pid}, min_version=min_version)
    await js.publish(S.prompts_train, encode(task), headers={"Nats-Msg-Id": f"{RUN}/prompt/{pid}"})


@pytest.mark.timeout(120)
async def test_a_prompt_waits_in_progress_for_its_version_then_runs_on_it(nc: Any, server: str) -> None:
    js = nc.jetstream()
    engine = SGLangClient(InferenceClientSettings(servers=[server]))
    # a poll far longer than the test: only the load report can release the held prompt in time
    config = WorkerConfig(worker="w", max_concurrent=4, fetch_timeout_s=0.2, ack_wait_s=ACK_WAIT_S, max_deliver=2, version_poll_s=60.0)
    worker = RolloutWorker(nc, RUN, OneSample(), engine, config)
    stopping = asyncio.Event()
    running = asyncio.create_task(worker.run(stopping))
    try:
        await publish(js, "held", min_version=2)
        await publish(js, "free", min_version=0)
        [free] = await collect(js, S.trajectories, 1, timeout_s=30)
        assert decode_group(free.data).meta.prompt_id == "free"
        assert worker.gate.version == 0  # the worker asked the server, which holds v0

        # held for many times ack_wait: still in progress, never redelivered, no group made on v0
        until = time.monotonic() + 5 * ACK_WAIT_S
        while time.monotonic() < until:
            info = await js.consumer_info(PROMPTS_STREAM, S.rollout_consumer)
            assert info.num_ack_pending == 1 and info.num_redelivered == 0, info
            await asyncio.sleep(0.2)

        async with httpx.AsyncClient() as http:
            reply = await http.post(f"{server}/update_weight_version", json={"new_version": "2"})
            assert reply.status_code == 200, reply.text
        await nc.publish(S.weights_loaded("srv"), encode(WeightsLoaded(run=RUN, server="srv", version=2, seconds=0.1)))
        got = await collect(js, S.trajectories, 2, timeout_s=30)
        held = decode_group(got[1].data).meta
        assert (held.prompt_id, held.head_version) == ("held", 2)
        assert worker.gate.waits == 1
    finally:
        stopping.set()
        await asyncio.wait_for(running, 15)
        await engine.aclose()


@pytest.mark.timeout(120)
async def test_stopping_hands_prompts_still_waiting_for_their_version_straight_back(nc: Any, nats_url: str, server: str) -> None:
    """At shutdown a prompt held for a version no one will make now (the trainer stops too) does not
    hold the worker for its drain timeout: it goes back to the queue at once, and nothing is lost."""
    js = nc.jetstream()
    own = await nats.connect(nats_url)  # the worker's own connection, ended as its process ends it
    engine = SGLangClient(InferenceClientSettings(servers=[server]))
    config = WorkerConfig(worker="w", max_concurrent=4, fetch_timeout_s=0.2, ack_wait_s=60, max_deliver=5, drain_timeout_s=60.0)
    worker = RolloutWorker(own, RUN, OneSample(), engine, config)
    stopping = asyncio.Event()
    running = asyncio.create_task(worker.run(stopping))
    try:
        await publish(js, "never", min_version=9)
        for _ in range(100):  # taken and held, in progress (the worker declares its consumer first)
            with contextlib.suppress(nats.js.errors.NotFoundError):
                if (await js.consumer_info(PROMPTS_STREAM, S.rollout_consumer)).num_ack_pending == 1:
                    break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the worker never took the prompt")
        stopping.set()
        t0 = time.monotonic()
        await asyncio.wait_for(running, 30)
        assert time.monotonic() - t0 < 10, "the held prompt kept the worker for its drain timeout"
    finally:
        stopping.set()
        await own.drain()  # as the service ends its connection
        await engine.aclose()
    # back in the queue now, not after ack_wait (60 s): the next worker to ask gets it at once
    sub = await js.pull_subscribe(S.prompts_all, durable=S.rollout_consumer, stream=PROMPTS_STREAM)
    [again] = await sub.fetch(1, timeout=10)
    assert decode(PromptTask, again.data).prompt_id == "never" and again.metadata.num_delivered == 2
