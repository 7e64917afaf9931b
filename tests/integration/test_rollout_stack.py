"""The rollout service with the real CPU inference server and the real reward service: RLVR and
multi-turn groups with their shapes, versions and logprobs; the JSONL dump; and a worker process
SIGKILLed mid-episode whose prompts another worker finishes, with no duplicate result."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from schemas.headers import is_rejection
from schemas.messages import RejectionMarker, decode
from schemas.subjects import PROMPTS_STREAM, Subjects
from schemas.trajectory import decode_group
from services.common.ports import free_port
from services.reward.client import RewardClient
from services.reward.service import RewardService
from services.reward.settings import RewardSettings
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.dump import TrajectoryDumper
from services.rollout.engine import SGLangClient
from services.rollout.worker import RolloutWorker
from services.rollout.worker_config import WorkerConfig
from services.rollout.workflows.multi_turn import MultiTurnWorkflow
from services.rollout.workflows.rlvr import RLVRWorkflow
from tests.support.reward import running_reward
from tests.support.rollout import RUN, collect, push_prompts, running_worker
from tests.support.waiting import wait_http_ok

S = Subjects(RUN)
ROOT = Path(__file__).resolve().parents[2]


def start_inference(model: Path, log: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.inference", f"model_path={model}", f"port={port}", "log_format=json", *extra],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )
    return proc, f"http://127.0.0.1:{port}"


def wait_health(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 90.0) -> None:
    wait_http_ok(f"{url}/health", timeout_s=timeout_s, proc=proc, log=log)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def inference(model: Path, log: Path, *extra: str) -> Iterator[str]:
    proc, url = start_inference(model, log, *extra)
    try:
        wait_health(proc, url, log)
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with inference(tiny_model, tmp_path_factory.mktemp("inf") / "server.log", "weight_version='3'") as url:
        yield url


@pytest.fixture
async def reward(nc: NATS, nats_url: str) -> AsyncIterator[RewardService]:
    async with running_reward(RewardSettings(run=RUN, nats_url=nats_url, processes=1), nc) as svc:
        yield svc


@contextlib.asynccontextmanager
async def worker(
    nc: NATS, workflow: Any, server: str, name: str = "w", dumper: TrajectoryDumper | None = None, **config: Any
) -> AsyncIterator[RolloutWorker]:
    engine = SGLangClient(InferenceClientSettings(servers=[server]))
    try:
        async with running_worker(nc, RUN, workflow, engine, stop_timeout_s=15, dumper=dumper, worker=name, **config) as w:
            yield w
    finally:
        await engine.aclose()


async def run_worker(nc: NATS, workflow: Any, server: str, n: int, dumper: TrajectoryDumper | None = None) -> list[Any]:
    async with worker(nc, workflow, server, dumper=dumper):
        await push_prompts(nc.jetstream(), n)
        return await collect(nc.jetstream(), S.trajectories, n, timeout_s=60)


async def test_rlvr_groups_carry_tokens_versions_logprobs_and_rewards(
    reward: RewardService, nc: NATS, server: str, tiny_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    wf = RLVRWorkflow(tok, RewardClient(nc), group_size=4, max_new_tokens=5)
    dumper = TrajectoryDumper(tmp_path, "exp", "t0", decode=lambda ids: tok.decode(ids))
    msgs = await run_worker(nc, wf, server, 3, dumper)
    assert len(msgs) == 3 and not any(is_rejection(m.headers) for m in msgs)
    for m in msgs:
        g = decode_group(m.data)
        t = g.tensors
        prompt_ids = tok(
            tok.apply_chat_template([{"role": "user", "content": "000="}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        ).input_ids
        assert t["input_ids"].shape[0] == 4
        plen = len(prompt_ids)
        assert (t["prompt_len"] == plen).all()
        assert (t["versions"][:, :plen] == -1).all() and (t["loss_mask"][:, :plen] == 0).all()
        gen = t["loss_mask"] == 1
        assert gen.any(axis=1).all() and (gen.sum(axis=1) <= 5).all()
        assert (t["versions"][gen] == 3).all() and (g.meta.head_version, g.meta.tail_version) == (3, 3)
        assert (t["logprobs"][gen] < 0).all() and t["logprobs"].dtype.name == "float32"
        answer = tok.decode(t["input_ids"][0, 1 : plen - 1])  # the prompt's digits, between <bos> and '='
        for i in range(4):
            completion = tok.decode(t["input_ids"][i][gen[i]], skip_special_tokens=True)
            expected = sum(a == b for a, b in zip(completion, answer, strict=False)) / 3
            assert t["rewards"][i] == pytest.approx(expected)
    rows = [json.loads(line) for p in sorted(tmp_path.rglob("*.jsonl")) for line in p.read_text().splitlines()]
    assert len(rows) == 12 and {r["head_version"] for r in rows} == {3}
    assert all(p.parent.name == "3" and p.parent.parent.name == "rollout" for p in tmp_path.rglob("*.jsonl"))
    assert {r["prompt"] for r in rows} == {"<bos>000=", "<bos>001=", "<bos>002="}


async def test_multi_turn_retries_with_feedback_and_discounts(reward: RewardService, nc: NATS, server: str, tiny_model: Path) -> None:
    # the untrained model almost never copies the digits, so conversations run all their turns
    wf = MultiTurnWorkflow(str(tiny_model), RewardClient(nc), group_size=2, max_turns=3, turn_discount=0.5, max_new_tokens=3)
    [msg] = await run_worker(nc, wf, server, 1)
    t = decode_group(msg.data).tensors
    for i in range(2):
        mask = t["loss_mask"][i]
        turns = int(((mask[1:] == 1) & (mask[:-1] == 0)).sum())  # generated segments
        assert 1 <= turns <= 3
        assert t["rewards"][i] <= 0.5 ** (turns - 1) + 1e-6
        if turns > 1:  # feedback tokens sit between the turns, untrained and unversioned
            fb = (mask == 0) & (t["attention_mask"][i] == 1) & (t["versions"][i] == -1)
            assert fb.sum() > int(t["prompt_len"][i])


def rollout_proc(nats_url: str, server: str, model: Path, name: str, log: Path) -> subprocess.Popen[bytes]:
    args = [
        f"run={RUN}", f"nats_url={nats_url}", f"inference.servers=[{server}]", f"model_path={model}", f"worker={name}",
        "group_size=2", "max_new_tokens=8", "max_concurrent=3", "ack_wait_s=1.5", "nak_delay_s=0.1", "log_format=json",
        "metrics_interval_s=0.5",
    ]
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "services.rollout", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


async def test_sigkilled_worker_loses_nothing_and_duplicates_nothing(
    reward: RewardService, nc: NATS, nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    js = nc.jetstream()
    # simulate mode: the same protocol at 0.25 s per token, so an episode lasts ~2 s and can be interrupted
    sim = ("simulate=true", "sim.token_latency_s=0.25", "sim.median_new_tokens=100")
    procs: list[subprocess.Popen[bytes]] = []
    with inference(tiny_model, tmp_path / "sim.log", *sim) as server:
        try:
            a = rollout_proc(nats_url, server, tiny_model, "A", tmp_path / "a.log")
            procs.append(a)
            deadline = asyncio.get_running_loop().time() + 60
            while True:  # wait until A's consumer exists, then give it work
                with contextlib.suppress(Exception):
                    await js.consumer_info(PROMPTS_STREAM, S.rollout_consumer)
                    break
                assert a.poll() is None, (tmp_path / "a.log").read_text()[-2000:]
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.05)
            ids = await push_prompts(js, 6)
            while (await js.consumer_info(PROMPTS_STREAM, S.rollout_consumer)).num_ack_pending < 3:
                assert asyncio.get_running_loop().time() < deadline, (tmp_path / "a.log").read_text()[-2000:]
                await asyncio.sleep(0.05)
            os.kill(a.pid, signal.SIGKILL)  # three episodes in flight in A
            a.wait(10)
            wf = RLVRWorkflow(str(tiny_model), RewardClient(nc), group_size=2, max_new_tokens=8)
            # B declares the consumer as A did (the last declaration wins), and runs in the test's loop
            async with worker(nc, wf, server, name="B", ack_wait_s=1.5, nak_delay_s=0.1):
                msgs = await collect(js, S.trajectories, 6, timeout_s=90)
        finally:
            for p in procs:
                stop(p)
    got = [m.headers["Jetrl-Prompt-Id"] for m in msgs]
    assert sorted(got) == sorted(ids)
    workers = [decode_group(m.data).meta.worker for m in msgs if not is_rejection(m.headers)]
    assert len(workers) == 6 and workers.count("B") >= 3  # the three A held were redelivered to B
    assert (await js.stream_info(PROMPTS_STREAM)).state.messages == 0


async def test_unreachable_inference_server_is_retried_then_rejected_with_the_error(nc: NATS, tiny_model: Path, tmp_path: Path) -> None:
    from tests.support.inference import spawn_server, wait_ready

    # The server serves when the worker starts (a worker takes no prompt before that), then goes away.
    server = await asyncio.to_thread(lambda: wait_ready(spawn_server(None, tmp_path, "simulate=true")))
    engine = SGLangClient(InferenceClientSettings(servers=[server.url], max_retries=0, connect_timeout_s=0.5))
    wf = RLVRWorkflow(str(tiny_model), RewardClient(nc), group_size=2)
    w = RolloutWorker(nc, RUN, wf, engine, WorkerConfig(worker="w", max_deliver=2, nak_delay_s=0.05, fetch_timeout_s=0.2))
    await w.declare()
    stopping = asyncio.Event()
    task = asyncio.create_task(w.run(stopping))
    try:
        for _ in range(600):  # until it has seen the server serve
            if w.gate.version is not None:
                break
            await asyncio.sleep(0.05)
        assert w.gate.version is not None, "the worker never saw its server serve"
        await asyncio.to_thread(server.stop, signal.SIGKILL)
        await push_prompts(nc.jetstream(), 2)
        msgs = await collect(nc.jetstream(), S.trajectories, 2)
    finally:
        stopping.set()
        await asyncio.wait_for(task, 15)
        await engine.aclose()
        server.stop(signal.SIGKILL)
    assert len(msgs) == 2 and all(is_rejection(m.headers) for m in msgs)
    reason = decode(RejectionMarker, msgs[0].data).reason
    assert "ServersUnavailableError" in reason and "attempt 2 of 2" in reason
    assert task.exception() is None  # the worker survived and stopped cleanly
