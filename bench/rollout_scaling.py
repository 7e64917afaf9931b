"""Rollout scaling: prompts/s with 1, 2 and 4 `jetrl rollout` worker processes (RLVR workflow, real
reward service) against a simulate-mode inference server that is not the bottleneck, as ratios to 1
worker (target: >= 3.5x at 4 workers; the `score`).

Also the bus overhead per trajectory message (target >= 0.5, as raw time / jetrl time): the
worker's publish path (headers, Nats-Msg-Id de-duplication, bounded wait for the ack) + the
consumer's fetch, against raw nats-py `js.publish` + fetch of the same bytes. And, for the whole
picture, the worker hop: a RolloutWorker with a workflow returning a fixed group (prompt fetched,
decoded, group encoded as Arrow, published, acked; result fetched) against raw nats-py relaying the
same bytes over the same hops.

Run: python bench/rollout_scaling.py   (prints a table, then a JSON line)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx
import nats
import nats.errors
from nats.js.api import ConsumerConfig, DeliverPolicy

from schemas.messages import MetricsEvent, PromptTask, decode, encode
from schemas.subjects import TRAJECTORIES_STREAM, Subjects
from services.bus.nats_server import NatsServer, free_port
from services.common.bus import declare_streams
from services.common.logging import configure_logging
from services.inference.make_model import build_model
from services.reward.service import RewardService
from services.reward.settings import RewardSettings
from services.rollout.worker import RolloutWorker
from services.rollout.worker_config import WorkerConfig
from services.rollout.workflow import RolloutWorkflow
from services.rollout.workflows.synthetic import SyntheticWorkflow

ROOT = Path(__file__).resolve().parents[1]
WORKERS = (1, 2, 4)
PROMPTS_PER_WORKER = 40
MAX_CONCURRENT = 4
GROUP = 4
NEW_TOKENS = 16
TOKEN_LATENCY_S = 0.05
BUS_MESSAGES = 400
REPEATS = 3


async def push(js: Any, run: str, n: int) -> None:
    subject = Subjects(run).prompts_train
    await asyncio.gather(
        *(
            js.publish(
                subject,
                encode(
                    PromptTask(
                        run=run, prompt_id=f"p{i}", data={"prompt": f"{i % 1000:03d}=", "answer": f"{i % 1000:03d}"}
                    )
                ),
            )
            for i in range(n)
        )
    )


async def drain(js: Any, subject: str, n: int, timeout_s: float = 300.0) -> int:
    sub = await js.pull_subscribe(
        subject, durable=None, stream=TRAJECTORIES_STREAM, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    )
    got = 0
    deadline = time.monotonic() + timeout_s
    while got < n and time.monotonic() < deadline:
        with contextlib.suppress(asyncio.TimeoutError, nats.errors.TimeoutError):
            msgs = await sub.fetch(min(100, n - got), timeout=0.5)
            for m in msgs:
                await m.ack()
            got += len(msgs)
    await sub.unsubscribe()
    return got


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


async def scaling(nc: Any, url: str, server: str, model: Path, tmp: Path) -> dict[int, float]:
    js = nc.jetstream()
    rates: dict[int, float] = {}
    for n in WORKERS:
        run = f"scale{n}"
        seen: set[str] = set()
        ready = asyncio.Event()

        # This size's set and event, bound now: a closure would read the loop variables when a message is
        # handled, and a callback that runs after the next iteration began would count into the next size.
        async def on_metrics(msg: Any, n: int = n, seen: set[str] = seen, ready: asyncio.Event = ready) -> None:
            seen.add(decode(MetricsEvent, msg.data).worker)
            if len(seen) >= n:
                ready.set()

        sub = await nc.subscribe(Subjects(run).metrics("rollout"), cb=on_metrics)
        procs = [
            start(["services.rollout", f"run={run}", f"nats_url={url}", f"inference.servers=[{server}]", f"model_path={model}",
                   f"worker=w{i}", f"group_size={GROUP}", f"max_new_tokens={NEW_TOKENS}", f"max_concurrent={MAX_CONCURRENT}",
                   "metrics_interval_s=0.2", "log_level=warning"], tmp / f"{run}-w{i}.log")
            for i in range(n)
        ]
        try:
            await asyncio.wait_for(ready.wait(), 180)
            prompts = PROMPTS_PER_WORKER * n
            t0 = time.perf_counter()
            await push(js, run, prompts)
            got = await drain(js, Subjects(run).trajectories, prompts)
            rates[n] = got / (time.perf_counter() - t0)
            assert got == prompts, f"{run}: {got} of {prompts} results"
        finally:
            await sub.unsubscribe()
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
    return rates


class FixedWorkflow(RolloutWorkflow):
    """Returns the same group every time: the bus comparison measures the worker, not a workflow."""

    def __init__(self, group: dict[str, Any]) -> None:
        self.group = group

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any]:
        return self.group


async def synthetic_group() -> dict[str, Any]:
    """One group as numpy arrays, what the bus comparisons send in every message."""
    tensors = await SyntheticWorkflow(group_size=GROUP, completion_len=NEW_TOKENS).arun_episode(None, {"prompt": "000="})
    assert tensors is not None
    return {k: v.numpy() for k, v in tensors.items()}


async def pulling(js: Any, consumer: str, timeout_s: float = 60.0) -> None:
    """Wait until a worker has a pull request waiting on the consumer (it is ready). The state is on the
    server, so this polls it; a worker that never pulls fails the bench instead of hanging it."""
    deadline = time.monotonic() + timeout_s
    while (await js.consumer_info("PROMPTS", consumer)).num_waiting < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no pull request waiting on {consumer} after {timeout_s:g} s")
        await asyncio.sleep(0.01)


async def pipeline_overhead(url: str) -> tuple[float, float]:
    """Best of REPEATS, alternating."""
    best = (float("inf"), float("inf"))
    for rep in range(REPEATS):
        ours, raw = await pipeline_once(url, rep)
        best = (min(best[0], ours), min(best[1], raw))
    return best


async def pipeline_once(url: str, rep: int) -> tuple[float, float]:
    """The whole worker hop (prompt in, Arrow encode, trajectory out, acks) against raw nats-py
    relaying the same bytes: (jetrl seconds per message, raw seconds per message)."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    try:
        group = await synthetic_group()
        wf = FixedWorkflow(group)
        worker = RolloutWorker(nc, f"busj{rep}", wf, None, WorkerConfig(worker="b", max_concurrent=16, fetch_timeout_s=0.2))
        await worker.declare()
        stopping = asyncio.Event()
        task = asyncio.create_task(worker.run(stopping))
        await pulling(js, Subjects(f"busj{rep}").rollout_consumer)
        t0 = time.perf_counter()
        await push(js, f"busj{rep}", BUS_MESSAGES)
        assert await drain(js, Subjects(f"busj{rep}").trajectories, BUS_MESSAGES) == BUS_MESSAGES
        ours = (time.perf_counter() - t0) / BUS_MESSAGES
        stopping.set()
        await task

        # the same hops with the same bytes, nothing else
        sample_prompt = encode(PromptTask(run=f"busx{rep}", prompt_id="p0", data={"prompt": "000=", "answer": "000"}))
        sample_traj = worker._encode(PromptTask(run=f"busx{rep}", prompt_id="p0", data={}), group, False)[0]
        s = Subjects(f"busx{rep}")
        await js.add_consumer("PROMPTS", ConsumerConfig(durable_name=s.rollout_consumer, filter_subject=s.prompts_all, ack_wait=60))
        psub = await js.pull_subscribe_bind(s.rollout_consumer, stream="PROMPTS")
        t0 = time.perf_counter()
        publishes = (js.publish(s.prompts_train, sample_prompt, headers={"Nats-Msg-Id": f"{rep}r{i}"}) for i in range(BUS_MESSAGES))
        await asyncio.gather(*publishes)

        async def relay() -> None:
            done = 0
            while done < BUS_MESSAGES:
                with contextlib.suppress(asyncio.TimeoutError, nats.errors.TimeoutError):
                    msgs = await psub.fetch(16, timeout=0.2)

                    async def one(m: Any, i: int) -> None:
                        await js.publish(s.trajectories, sample_traj, headers={"Nats-Msg-Id": f"{rep}t{i}"})
                        await m.ack()

                    await asyncio.gather(*(one(m, done + k) for k, m in enumerate(msgs)))
                    done += len(msgs)

        relay_task = asyncio.create_task(relay())
        assert await drain(js, s.trajectories, BUS_MESSAGES) == BUS_MESSAGES
        await relay_task
        raw = (time.perf_counter() - t0) / BUS_MESSAGES
        return ours, raw
    finally:
        await nc.close()


async def bus_overhead(url: str) -> tuple[float, float]:
    """One trajectory message on the bus: the worker's publish (headers, Nats-Msg-Id de-duplication,
    bounded wait for the stream's ack), 16 at once as a worker with max_concurrent 16 does, then the
    consumer's fetch; against raw `js.publish` + fetch of the same bytes at the same concurrency."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    try:
        group = await synthetic_group()
        worker = RolloutWorker(nc, "busp", FixedWorkflow(group), None, WorkerConfig(worker="b"))
        body = worker._encode(PromptTask(run="busp", prompt_id="p", data={}), group, False)[0]
        sem = asyncio.Semaphore(16)

        async def bounded(coro: Any) -> None:
            async with sem:
                await coro

        async def timed(run: str, publish: Any) -> float:
            t0 = time.perf_counter()
            await asyncio.gather(*(bounded(publish(i)) for i in range(BUS_MESSAGES)))
            assert await drain(js, Subjects(run).trajectories, BUS_MESSAGES) == BUS_MESSAGES
            return (time.perf_counter() - t0) / BUS_MESSAGES

        from schemas.headers import trajectory_headers
        from schemas.trajectory import TrajectoryMeta

        def ours(run: str) -> Any:
            def publish(i: int) -> Any:
                meta = TrajectoryMeta(run=run, prompt_id=f"p{i}", worker="b", head_version=0, tail_version=0)
                return worker._publish(Subjects(run).trajectories, body, trajectory_headers(meta))

            return publish

        def raw(run: str) -> Any:
            return lambda i: js.publish(Subjects(run).trajectories, body)

        # alternate, best of REPEATS each: the machine is shared and the first run warms the server
        best_ours = best_raw = float("inf")
        for rep in range(REPEATS):
            best_raw = min(best_raw, await timed(f"busr{rep}", raw(f"busr{rep}")))
            best_ours = min(best_ours, await timed(f"busp{rep}", ours(f"busp{rep}")))
        return best_ours, best_raw
    finally:
        await nc.close()


async def main() -> None:
    configure_logging("warning", "console")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = build_model(tmp / "tiny")
        port = free_port()
        sim = start(["services.inference", "simulate=true", f"port={port}", f"sim.token_latency_s={TOKEN_LATENCY_S}",
                     f"sim.median_new_tokens={NEW_TOKENS * 4}", "max_batch_size=512", "log_level=warning"], tmp / "sim.log")
        server = f"http://127.0.0.1:{port}"
        with NatsServer(tmp / "nats") as ns:
            try:
                deadline = time.monotonic() + 120
                async with httpx.AsyncClient(timeout=1) as http:
                    while True:
                        with contextlib.suppress(httpx.HTTPError):
                            if (await http.get(f"{server}/health")).status_code == 200:
                                break
                        assert time.monotonic() < deadline and sim.poll() is None, (tmp / "sim.log").read_text()
                        await asyncio.sleep(0.05)
                nc = await nats.connect(ns.url)
                await declare_streams(nc.jetstream())
                reward = RewardService(RewardSettings(nats_url=ns.url, processes=1), nc)
                await reward.start()
                try:
                    rates = await scaling(nc, ns.url, server, model, tmp)
                finally:
                    await reward.stop(timeout_s=5)
                    await nc.close()
                ours, raw = await bus_overhead(ns.url)
                pipe, pipe_raw = await pipeline_overhead(ns.url)
            finally:
                sim.terminate()
                sim.wait(30)

    base = rates[1]
    print(f"rollout scaling: RLVR, group {GROUP}, {NEW_TOKENS} new tokens at {TOKEN_LATENCY_S}s/token (simulate), "
          f"max_concurrent {MAX_CONCURRENT}")
    print(f"{'workers':>8} {'prompts/s':>10} {'vs 1 worker':>12}")
    for n, r in rates.items():
        print(f"{n:>8} {r:>10.2f} {r / base:>11.2f}x")
    print(f"{'per trajectory message':<34} {'jetrl ms':>9} {'raw ms':>9} {'raw/jetrl':>10}")
    print(f"{'bus (publish + fetch)':<34} {ours * 1e3:>9.3f} {raw * 1e3:>9.3f} {raw / ours:>10.2f}")
    print(f"{'worker hop (incl. Arrow encode)':<34} {pipe * 1e3:>9.3f} {pipe_raw * 1e3:>9.3f} {pipe_raw / pipe:>10.2f}")
    figures = {
        "score": round(rates[4] / base, 3),
        "speedup_2": round(rates[2] / base, 3),
        "prompts_per_s": {str(n): round(r, 2) for n, r in rates.items()},
        "bus_ratio": round(raw / ours, 3),
        "bus_ms_jetrl": round(ours * 1e3, 3),
        "bus_ms_raw": round(raw * 1e3, 3),
        "worker_hop_ratio": round(pipe_raw / pipe, 3),
        "worker_hop_ms_jetrl": round(pipe * 1e3, 3),
        "worker_hop_ms_raw": round(pipe_raw * 1e3, 3),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    asyncio.run(main())
