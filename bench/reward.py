"""Reward service throughput: items/s through `jetrl reward` (a separate process, over a real
nats-server, scoring in its process pool) as a ratio to calling the same function in-process in a
loop, measured in the same run. Two functions: a cheap one (pure overhead) and one that burns 10 ms
of CPU per item (a verifier that computes); pools of 1 and 2 processes.

The client keeps 4 requests of 16 items in flight. On a 2-core machine the client, the service and
its pool share the cores, so 2 processes cannot reach 2x. Headline (`score`): the 10 ms function
with 2 processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH = 16
IN_FLIGHT = 4


def cheap(completion: str = "", answer: str = "", **_: Any) -> float:
    return 1.0 if completion == answer else 0.0


def cpu_10ms(completion: str = "", answer: str = "", **_: Any) -> float:
    """Keeps a core busy for 10 ms of wall time, like a verifier that computes (not one that sleeps)."""
    end = time.perf_counter() + 0.010
    x = 0
    while time.perf_counter() < end:
        x += 1
    return 1.0 if completion == answer else 0.0


def in_process_rate(fn: Any, n: int) -> float:
    kwargs = {"prompt": "123=", "completion": "123", "prompt_ids": [1, 2, 3, 4], "completion_ids": [1, 2, 3], "answer": "123"}
    t0 = time.perf_counter()
    for _ in range(n):
        fn(**kwargs)
    return n / (time.perf_counter() - t0)


async def service_rate(nats_url: str, ref: str, n: int) -> float:
    from schemas.messages import RewardItem
    from services.common.bus import connect
    from services.reward.client import RewardClient

    nc = await connect(nats_url, "bench")
    client = RewardClient(nc, timeout_s=120)
    batch = [RewardItem(prompt="123=", completion="123", prompt_ids=[1, 2, 3, 4], completion_ids=[1, 2, 3], data={"answer": "123"})] * BATCH
    await client.score(ref, batch)  # first call checks the function in the pool
    todo = n // BATCH

    async def lane() -> None:
        nonlocal todo
        while todo > 0:
            todo -= 1
            results = await client.score(ref, batch)
            assert all(r.status == "ok" for r in results), results[0]

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(IN_FLIGHT)))
    rate = (n // BATCH) * BATCH / (time.perf_counter() - t0)
    await nc.close()
    return rate


async def wait_ready(nats_url: str, proc: subprocess.Popen[bytes]) -> None:
    from services.common.bus import connect

    nc = await connect(nats_url, "bench-ready")
    try:
        while True:
            try:
                await nc.request("$SRV.PING.jetrl-reward", b"", timeout=0.5)
                return
            except Exception:
                if proc.poll() is not None:
                    raise RuntimeError("the reward service exited before it was ready") from None
                # "no responders" comes back at once while the service starts: do not spin on it
                await asyncio.sleep(0.05)
    finally:
        await nc.close()


def main() -> None:
    from services.bus.nats_server import NatsServer
    from services.common.logging import configure_logging

    configure_logging("error", "console")  # keep the table readable

    counts = {"cheap": (20_000, 1600), "cpu_10ms": (200, 480)}  # (in-process items, service items)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            for processes in (1, 2):
                env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "JETRL_REWARD__ALLOW": '["bench.reward:*"]'}
                proc = subprocess.Popen(
                    [sys.executable, "-m", "services.reward", f"nats_url={server.url}", f"processes={processes}", "log_level=warning"],
                    cwd=ROOT, env=env,
                )
                try:
                    asyncio.run(wait_ready(server.url, proc))
                    for name, fn in (("cheap", cheap), ("cpu_10ms", cpu_10ms)):
                        local_n, service_n = counts[name]
                        # the baseline before and after, averaged: other load on the machine hits both alike
                        before = in_process_rate(fn, local_n)
                        through = asyncio.run(service_rate(server.url, f"bench.reward:{name}", service_n))
                        local = (before + in_process_rate(fn, local_n)) / 2
                        rows.append((name, processes, local, through, through / local))
                finally:
                    proc.terminate()
                    proc.wait(30)
        finally:
            server.stop()

    print(f"{'function':<10}{'processes':>10}{'in-process items/s':>20}{'service items/s':>17}{'ratio':>8}")
    for name, processes, local, through, ratio in rows:
        print(f"{name:<10}{processes:>10}{local:>20.0f}{through:>17.0f}{ratio:>8.2f}")
    print(f"ratio = service items/s / in-process items/s; batches of {BATCH}, {IN_FLIGHT} requests in flight, {os.cpu_count()} cores")
    figures: dict[str, float] = {f"ratio_{n}_{p}proc": round(r, 3) for n, p, _, _, r in rows}
    figures |= {f"items_per_s_{n}_{p}proc": round(t, 1) for n, p, _, t, _ in rows}
    figures["score"] = figures["ratio_cpu_10ms_2proc"]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
