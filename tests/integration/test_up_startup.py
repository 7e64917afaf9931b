"""Start-up order without waits between services: a rollout worker started before its inference server
(as `jetrl up`, compose and k8s start them: all at once) takes no prompt until a server serves, then
runs it on that server. Real nats-server, a real (simulated) inference server started later on the
address the worker was given."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from schemas.messages import PromptTask, encode
from schemas.subjects import PROMPTS_STREAM, Subjects
from schemas.trajectory import decode_group
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import SGLangClient
from services.rollout.worker import RolloutWorker
from services.rollout.worker_config import WorkerConfig
from tests.integration.test_rollout_version_gate import OneSample
from tests.support.inference import ServerProcess, free_port, wait_ready
from tests.support.rollout import RUN, collect

S = Subjects(RUN)


def spawn_simulated(port: int, log_dir: Path) -> ServerProcess:
    log = log_dir / f"inference-{port}.log"
    args = [f"port={port}", "log_format=json", "simulate=true", "sim.token_latency_s=0.001", "sim.median_new_tokens=3"]
    proc = subprocess.Popen([sys.executable, "-m", "services.inference", *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log)


async def publish(js: Any, pid: str) -> None:
    task = PromptTask(run=RUN, prompt_id=pid, data={"id": pid}, min_version=0)
    await js.publish(S.prompts_train, encode(task), headers={"Nats-Msg-Id": f"{RUN}/prompt/{pid}"})


@pytest.mark.timeout(180)
async def test_a_worker_started_before_its_server_takes_no_prompt_until_the_server_serves(nc: Any, tmp_path: Path) -> None:
    js = nc.jetstream()
    port = free_port()
    engine = SGLangClient(InferenceClientSettings(servers=[f"http://127.0.0.1:{port}"]))
    config = WorkerConfig(worker="w", max_concurrent=4, fetch_timeout_s=0.2, ack_wait_s=5.0, max_deliver=2, version_poll_s=0.1)
    worker = RolloutWorker(nc, RUN, OneSample(), engine, config)
    await worker.declare()  # the shared consumer exists before the worker runs (run() declares it too)
    stopping = asyncio.Event()
    running = asyncio.create_task(worker.run(stopping))
    server: ServerProcess | None = None
    try:
        await publish(js, "early")
        # No server at the address: for many polls the prompt stays in the stream, untouched (an
        # episode sent now could only fail, and a failed prompt is retried later or rejected).
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            info = await js.consumer_info(PROMPTS_STREAM, S.rollout_consumer)
            assert info.delivered.stream_seq == 0 and info.num_ack_pending == 0, info
            assert worker.stats.in_flight == 0
            await asyncio.sleep(0.2)
        assert not running.done()

        server = await asyncio.to_thread(lambda: wait_ready(spawn_simulated(port, tmp_path)))
        [got] = await collect(js, S.trajectories, 1, timeout_s=60)
        meta = decode_group(got.data).meta
        assert (meta.prompt_id, meta.head_version) == ("early", 0)
        info = await js.consumer_info(PROMPTS_STREAM, S.rollout_consumer)
        assert info.num_redelivered == 0, info  # taken once, run once
        assert worker.gate.version == 0
    finally:
        stopping.set()
        await asyncio.wait_for(running, 15)
        await engine.aclose()
        if server is not None:
            server.stop()


@pytest.mark.timeout(60)
async def test_a_worker_waiting_for_its_servers_stops_at_once_on_sigterm(nc: Any) -> None:
    engine = SGLangClient(InferenceClientSettings(servers=[f"http://127.0.0.1:{free_port()}"]))
    worker = RolloutWorker(nc, RUN, OneSample(), engine, WorkerConfig(worker="w", version_poll_s=30.0))
    await worker.declare()
    stopping = asyncio.Event()
    running = asyncio.create_task(worker.run(stopping))
    try:
        for _ in range(400):  # until it has asked the (absent) server at least once
            if worker.gate._reading is not None:
                break
            await asyncio.sleep(0.05)
        assert worker.gate._reading is not None, "the worker never asked its server for a version"
        stopping.set()
        await asyncio.wait_for(running, 10)  # not after its 30 s poll
        info = await nc.jetstream().consumer_info(PROMPTS_STREAM, S.rollout_consumer)
        assert info.delivered.stream_seq == 0
    finally:
        stopping.set()
        await engine.aclose()
