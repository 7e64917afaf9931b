"""CPU cost of the reward service: CPU-seconds of `jetrl reward` (the service process, its fork server
and its pool processes) to start, and per 1000 samples scored, under the load the demo puts on it:
requests of one group (8 copy3 samples, as a rollout worker sends them), paced at `rate` requests/s.

CPU time is read from /proc (utime + stime of every process under the service, plus what it reaped),
so other load on the machine does not count; the driver's own CPU is not counted either. The baseline,
measured in the same run: the same function called in this process on the same items (CPU-seconds
per 1000 samples, `time.process_time`). `score` = baseline / the service's CPU per 1000 samples: the
share of the service's cost that is the scoring itself (1.0 = no overhead).

    python bench/reward_cpu.py                     # this tree
    python bench/reward_cpu.py --trees A B --rounds 2   # A B A B: two checkouts in the same run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.reward import wait_ready  # noqa: E402  (after the sys.path line)

HZ = os.sysconf("SC_CLK_TCK")
FN = "services.reward.builtin:copy3"
GROUP = 8


def tree_cpu(root: int) -> tuple[float, float]:
    """CPU-seconds of `root` and of its live descendants (each with the children it has reaped)."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = sum(int(f) for f in fields[11:15]) / HZ  # utime stime cutime cstime
    below, todo = {root}, [root]
    while todo:
        p = todo.pop()
        for child, par in parent.items():
            if par == p and child not in below:
                below.add(child)
                todo.append(child)
    return cpu.get(root, 0.0), sum(cpu.get(p, 0.0) for p in below - {root})


async def drive(url: str, requests: int, rate: float, in_flight: int) -> int:
    from schemas.messages import RewardItem
    from services.common.bus import connect
    from services.common.demo_task import make_copy3_rows
    from services.reward.client import RewardClient

    nc = await connect(url, "bench")
    client = RewardClient(nc, timeout_s=60)
    rows = make_copy3_rows(64)
    groups = []
    for row in rows:
        prompt = f"<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n"
        data = {k: v for k, v in row.items() if k != "prompt"}
        groups.append([
            RewardItem(
                prompt=prompt, completion=row["answer"][: 1 + i % 3], prompt_ids=list(range(20)), completion_ids=[5, 6, 7, 8], data=data
            )
            for i in range(GROUP)
        ])
    await client.score(FN, groups[0])  # the first call checks the function in the pool
    slots = asyncio.Semaphore(in_flight)
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        try:
            results = await client.score(FN, groups[i % len(groups)])
            assert all(r.status == "ok" for r in results), results[0]
            done += len(results)
        finally:
            slots.release()

    tasks = []
    t0 = time.perf_counter()
    for i in range(requests):
        await slots.acquire()
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(max(0.0, t0 + (i + 1) / rate - time.perf_counter()))
    await asyncio.gather(*tasks)
    await nc.close()
    return done


def measure(tree: Path, url: str, requests: int, rate: float, in_flight: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.reward", f"nats_url={url}", "log_level=warning", "metrics_interval_s=1000"], cwd=tree, env=env
    )
    try:
        asyncio.run(wait_ready(url, proc))  # bench/reward.py's: the service answers its ping
        start = tree_cpu(proc.pid)
        samples = asyncio.run(drive(url, requests, rate, in_flight))
        end = tree_cpu(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    per = [1000 * (e - s) / samples for s, e in zip(start, end, strict=True)]
    return {
        "start_cpu_s": round(sum(start), 2),
        "start_service_s": round(start[0], 2),
        "start_pool_s": round(start[1], 2),
        "cpu_s_per_1000": round(sum(per), 3),
        "service_per_1000": round(per[0], 3),
        "pool_per_1000": round(per[1], 3),
        "samples": samples,
    }


def in_process_cpu(samples: int) -> float:
    """CPU-seconds per 1000 samples of calling the function in this process on the bench's items."""
    from services.common.demo_task import make_copy3_rows
    from services.reward.builtin import copy3
    from services.reward.calling import caller

    call = caller(copy3)  # as a pool process calls it: by its signature
    rows = make_copy3_rows(64)
    t0 = time.process_time()
    for i in range(samples):
        row = rows[(i // GROUP) % len(rows)]
        data = {k: v for k, v in row.items() if k != "prompt"}
        call({"prompt": row["prompt"], "completion": row["answer"][: 1 + i % 3], "prompt_ids": list(range(20)),
              "completion_ids": [5, 6, 7, 8], **data})
    return 1000 * (time.process_time() - t0) / samples


def main() -> None:
    from services.bus.nats_server import NatsServer
    from services.common.logging import configure_logging

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=[str(ROOT)], help="checkouts to compare, run alternately")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--requests", type=int, default=1500, help="requests of 8 samples per measurement")
    ap.add_argument("--rate", type=float, default=150.0, help="requests/s (the demo sends ~140)")
    ap.add_argument("--in-flight", type=int, default=32)
    args = ap.parse_args()
    configure_logging("error", "console")
    rows = []
    baseline = in_process_cpu(args.requests * GROUP)
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            for r in range(args.rounds):
                for tree in args.trees:
                    load = os.getloadavg()[0]
                    rows.append({"tree": tree, "round": r, "load1": round(load, 2),
                                 **measure(Path(tree), server.url, args.requests, args.rate, args.in_flight)})
        finally:
            server.stop()
    print(f"{'tree':<40} {'round':>5} {'load':>5} {'start cpu-s':>11} {'per 1k: all':>11} {'service':>8} {'pool':>6}")
    for row in rows:
        print(f"{str(row['tree'])[-40:]:<40} {row['round']:>5} {row['load1']:>5.1f} {row['start_cpu_s']:>11.2f} "
              f"{row['cpu_s_per_1000']:>11.3f} {row['service_per_1000']:>8.3f} {row['pool_per_1000']:>6.3f}")
    print(f"in-process baseline: {baseline:.4f} CPU-s per 1000 samples")
    medians = {}
    for tree in args.trees:
        per = sorted(r["cpu_s_per_1000"] for r in rows if r["tree"] == tree)
        medians[tree] = per[len(per) // 2]
    first = medians[args.trees[0]]
    print(json.dumps({"score": round(baseline / first, 4) if first else 0.0, "in_process_per_1000_s": round(baseline, 4),
                      "service_per_1000_s": medians, "rows": rows}))


if __name__ == "__main__":
    main()
