"""Trajectory throughput on a replicated stream: publish N copy3-sized groups (real Arrow messages)
to TRAJECTORIES and consume them with a durable pull consumer, on a 3-node JetStream cluster on
loopback with the streams at 3 replicas, against the same on 1 replica, in the same run.

    python bench/cluster.py [--groups 2000]

No target: it prints what replication costs here (all three nodes share this machine's cores, so a
real cluster of separate machines pays less). `score` = R3 throughput / R1 throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.subjects import TRAJECTORIES_STREAM, Subjects
from schemas.trajectory import encode_group
from services.bus.nats_cluster import NatsCluster
from services.common.bus import connect, declare_streams
from services.common.logging import configure_logging


def group(seed: int) -> bytes:
    """A copy3 group as the rollout worker sends it: 8 samples of 5 prompt + 4 completion tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 48, size=(8, 9))
    mask = np.zeros_like(ids)
    mask[:, 5:] = 1
    tensors = {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": mask,
               "logprobs": ((rng.random((8, 9)) * -2) * mask).astype(np.float32), "rewards": rng.random(8).astype(np.float32),
               "versions": np.where(mask > 0, 3, -1)}
    return encode_group(tensors, run="bench", prompt_id=f"p{seed}", worker="bench")


async def measure(url: str, replicas: int, payloads: list[bytes]) -> float:
    """Messages per second through publish (acked) + fetch + ack, with 64 publishes in flight."""
    nc = await connect(url, f"bench-r{replicas}")
    js = nc.jetstream()
    await declare_streams(js, replicas=replicas)
    subject = Subjects("bench").trajectories
    sub = await js.pull_subscribe(subject, durable=f"bench-r{replicas}", stream=TRAJECTORIES_STREAM)
    started = time.perf_counter()

    async def produce() -> None:
        window: list[asyncio.Future[object]] = []
        for i, data in enumerate(payloads):
            window.append(asyncio.ensure_future(js.publish(subject, data, headers={"Nats-Msg-Id": f"r{replicas}/{i}"})))
            if len(window) >= 64:
                await asyncio.gather(*window)
                window.clear()
        await asyncio.gather(*window)

    async def consume() -> None:
        seen = 0
        while seen < len(payloads):
            try:
                msgs = await sub.fetch(256, timeout=2)
            except TimeoutError:
                continue
            for m in msgs:
                await m.ack()
            seen += len(msgs)

    await asyncio.gather(produce(), consume())
    elapsed = time.perf_counter() - started
    await js.delete_stream(TRAJECTORIES_STREAM)
    await nc.close()
    return len(payloads) / elapsed


async def main_async(groups: int) -> dict[str, float]:
    payloads = [group(i) for i in range(groups)]
    with tempfile.TemporaryDirectory() as tmp, NatsCluster(Path(tmp) / "c", 3) as cluster:
        r1 = await measure(cluster.url, 1, payloads)
        r3 = await measure(cluster.url, 3, payloads)
    return {"r1_msgs_per_s": r1, "r3_msgs_per_s": r3, "bytes_per_msg": float(np.mean([len(p) for p in payloads]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2000)
    args = parser.parse_args()
    configure_logging("warning", "console")
    figures = asyncio.run(main_async(args.groups))
    ratio = figures["r3_msgs_per_s"] / figures["r1_msgs_per_s"]
    size = f"{args.groups} groups of {figures['bytes_per_msg']:.0f} B, 3-node cluster on loopback"
    print(f"{'stream replicas':<18} {'groups/s':>10}   ({size})")
    print(f"{'R1':<18} {figures['r1_msgs_per_s']:>10.0f}")
    print(f"{'R3':<18} {figures['r3_msgs_per_s']:>10.0f}")
    print(f"R3 / R1 = {ratio:.2f}")
    print(json.dumps({"score": round(ratio, 3), **{k: round(v, 1) for k, v in figures.items()}}))


if __name__ == "__main__":
    main()
