"""Replay read throughput: groups/s that `jetrl replay` reads and decodes from a recorded trajectory
stream (its `open_records`: the ordered pull reader, each pull's groups decoded; then the range
filters and the trainer's intake judging each group; training excluded), as a ratio to a raw
JetStream fetch of the same messages in the same run (an ephemeral pull consumer, no acks, nothing
done with the bytes).

Groups of 8 samples x up to `--seqlen` tokens (about what a GRPO group of short math answers holds).
Target: ratio >= 0.5. Rounds alternate raw / replay; medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nats.js.api import AckPolicy, ConsumerConfig

from schemas.headers import trajectory_headers
from schemas.subjects import TRAJECTORIES_STREAM, Subjects
from schemas.trajectory import encode_group, group_to_table
from services.common.bus import connect, declare_streams
from services.common.nats_server import NatsServer
from services.replay.reader import StreamReader
from services.replay.settings import RangeSettings, ReplaySettings
from services.replay.source import RecordingSource, open_records, replay_window
from services.trainer.intake.intake import Intake

RUN = "bench"


def make_group(rng: np.random.Generator, batch: int, seqlen: int, version: int) -> dict[str, np.ndarray]:
    lengths = rng.integers(seqlen // 2, seqlen + 1, batch)
    mask = (np.arange(seqlen)[None, :] < lengths[:, None]).astype(np.int64)
    completion = (np.arange(seqlen)[None, :] >= 64) & (mask == 1)
    return {
        "input_ids": rng.integers(0, 150_000, (batch, seqlen)) * mask,
        "attention_mask": mask,
        "loss_mask": completion.astype(np.int64),
        "logprobs": (-rng.random((batch, seqlen)) * completion).astype(np.float32),
        "rewards": rng.random(batch).astype(np.float32),
        "versions": np.where(completion, version, -1).astype(np.int64),
    }


async def record(js: Any, n: int, batch: int, seqlen: int) -> int:
    rng = np.random.default_rng(0)
    pool = [make_group(rng, batch, seqlen, v) for v in range(16)]
    total = 0
    window: list[Any] = []
    for i in range(n):
        tensors, pid = pool[i % len(pool)], f"0-{i}"
        _, meta = group_to_table(tensors, run=RUN, prompt_id=pid, worker="w")
        data = encode_group(tensors, run=RUN, prompt_id=pid, worker="w")
        total += len(data)
        window.append(js.publish(Subjects(RUN).trajectories, data, headers=trajectory_headers(meta), stream=TRAJECTORIES_STREAM))
        if len(window) == 64:
            await asyncio.gather(*window)
            window = []
    await asyncio.gather(*window)
    return total


async def raw_fetch(js: Any, n: int, fetch_batch: int) -> float:
    """Seconds to fetch n messages with an ephemeral no-ack pull consumer; nothing else."""
    cfg = ConsumerConfig(ack_policy=AckPolicy.NONE, filter_subjects=[Subjects(RUN).trajectories], mem_storage=True,
                         num_replicas=1, inactive_threshold=60.0)
    t0 = time.perf_counter()
    sub = await js.pull_subscribe(Subjects(RUN).trajectories, stream=TRAJECTORIES_STREAM, config=cfg)
    got = 0
    while got < n:
        got += len(await sub.fetch(fetch_batch, timeout=5))
    elapsed = time.perf_counter() - t0
    await js.delete_consumer(TRAJECTORIES_STREAM, sub._consumer)
    await sub.unsubscribe()
    return elapsed


async def replay_read(js: Any, n: int, fetch_batch: int) -> float:
    """Seconds for replay's read path over the same messages: reader + decoding + filters + the intake."""
    settings = ReplaySettings(run=f"{RUN}-offline", source_run=RUN, fetch_batch=fetch_batch)
    source = RecordingSource(settings, Intake(replay_window(settings), own_versions=False))
    t0 = time.perf_counter()
    accepted = 0
    async for record in open_records(settings, js, 0):
        if source.judge(record, 0) is not None:
            accepted += 1
    elapsed = time.perf_counter() - t0
    if accepted != n:
        raise RuntimeError(f"replay accepted {accepted} of {n} groups")
    return elapsed


async def reader_only(js: Any, n: int, fetch_batch: int) -> float:
    """Seconds for the reader alone (ordering, range bounds, records), no decode: where the time goes."""
    t0 = time.perf_counter()
    got = sum([1 async for _ in StreamReader(js, RUN, RangeSettings(), batch=fetch_batch)])
    if got != n:
        raise RuntimeError(f"reader yielded {got} of {n} messages")
    return time.perf_counter() - t0


async def main(args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            nc = await connect(server.url, "bench-replay")
            js = nc.jetstream()
            await declare_streams(js)
            nbytes = await record(js, args.groups, args.group_size, args.seqlen)
            raw, rep, rdr = [], [], []
            for _ in range(args.rounds):
                raw.append(await raw_fetch(js, args.groups, args.fetch_batch))
                rep.append(await replay_read(js, args.groups, args.fetch_batch))
                rdr.append(await reader_only(js, args.groups, args.fetch_batch))
            await nc.close()
        finally:
            server.stop()
    raw_s, rep_s, rdr_s = statistics.median(raw), statistics.median(rep), statistics.median(rdr)
    figures = {
        "groups": float(args.groups),
        "mean_group_kib": nbytes / args.groups / 1024,
        "raw_fetch_groups_per_s": args.groups / raw_s,
        "replay_groups_per_s": args.groups / rep_s,
        "reader_only_groups_per_s": args.groups / rdr_s,
        "raw_fetch_mb_per_s": nbytes / raw_s / 1e6,
        "replay_mb_per_s": nbytes / rep_s / 1e6,
    }
    figures["score"] = figures["replay_groups_per_s"] / figures["raw_fetch_groups_per_s"]
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--fetch-batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    out = asyncio.run(main(parser.parse_args()))
    print(f"{'path':<34}{'groups/s':>12}{'MB/s':>10}")
    print(f"{'raw JetStream fetch (baseline)':<34}{out['raw_fetch_groups_per_s']:>12.0f}{out['raw_fetch_mb_per_s']:>10.1f}")
    print(f"{'replay reader alone (no decode)':<34}{out['reader_only_groups_per_s']:>12.0f}{'':>10}")
    print(f"{'replay read + decode':<34}{out['replay_groups_per_s']:>12.0f}{out['replay_mb_per_s']:>10.1f}")
    print(f"groups of {out['mean_group_kib']:.1f} KiB; ratio replay / raw = {out['score']:.2f} (target >= 0.5)")
    print(json.dumps({k: round(v, 4) for k, v in out.items()}))
