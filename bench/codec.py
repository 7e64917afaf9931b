"""Trajectory codec throughput: encode + decode of groups of 8 samples x up to 4k tokens, as a ratio
to a plain memory copy of the same padded tensor bytes, measured in the same run.

A copy is the least any transport must do with the tensors; the codec also drops padding, casts to
the Arrow column types, builds one IPC message, and rebuilds the padded dict on the other side.
Target (issue #2): ratio >= 0.3.

The copy baseline is the faster of two copies of the group, and both are printed:
- `a.copy()` of each tensor (fresh arrays). On this kind of VM (AMD EPYC, glibc 2.36) it swings
  tenfold with where the allocator puts the copy: when the destination sits 16 bytes past the source
  modulo 4096 (as for consecutive same-size blocks), memcpy's loads alias its own stores and it runs
  at ~3 GB/s instead of ~30 GB/s.
- `np.copyto` into destinations taken from one preallocated buffer, which avoids that alignment: the
  machine's real copy speed.
Taking the faster one keeps the score honest whichever way the allocator falls.

`ipc ratio` times only the Arrow IPC part of the same round trip: writing the already-built record
batch as a stream and reading it back, with no conversion from or to the padded tensors. It shows
how much of the codec's cost is Arrow's and how much is the conversion (dropping padding, casting to
the contract's column types with range checks, rebuilding the padded arrays).

The last row (8 x 32k) is not part of the score: it shows how much of the codec's cost is per call
rather than per byte.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa

from schemas.trajectory import decode_group, encode_group, group_to_table


def make_group(rng: np.random.Generator, batch: int, seqlen: int, full: bool) -> dict[str, np.ndarray]:
    lengths = np.full(batch, seqlen) if full else rng.integers(seqlen // 2, seqlen + 1, batch)
    mask = (np.arange(seqlen)[None, :] < lengths[:, None]).astype(np.int64)
    completion = (np.arange(seqlen)[None, :] >= 256) & (mask == 1)
    return {
        "input_ids": rng.integers(0, 150_000, (batch, seqlen)) * mask,
        "attention_mask": mask,
        "loss_mask": completion.astype(np.int64),
        "logprobs": np.where(completion, -rng.random((batch, seqlen)), 0).astype(np.float32),
        "rewards": rng.random(batch).astype(np.float32),
        "versions": np.where(completion, 7, -1 * mask).astype(np.int64),
    }


def best_of(fn: Callable[[], object], repeats: int, inner: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def copy_into(group: dict[str, np.ndarray]) -> Callable[[], None]:
    """A copy of the group into destinations carved out of one buffer, 64 bytes apart: no 4K aliasing."""
    pool = np.empty(sum(a.nbytes + 64 for a in group.values()), dtype=np.uint8)
    dests, at = [], 64
    for a in group.values():
        dests.append((pool[at : at + a.nbytes].view(a.dtype).reshape(a.shape), a))
        at += a.nbytes + 64

    def copy() -> None:
        for d, a in dests:
            np.copyto(d, a)

    return copy


def fresh_copy(group: dict[str, np.ndarray]) -> Callable[[], object]:
    """`a.copy()` of every tensor: numpy allocates each destination afresh."""
    return lambda: [a.copy() for a in group.values()]


def round_trip(group: dict[str, np.ndarray]) -> Callable[[], object]:
    """What is measured: encode the group as one message and decode it back."""
    return lambda: decode_group(encode_group(group, run="b", prompt_id="p", worker="w"))


def ipc_only(group: dict[str, np.ndarray]) -> Callable[[], object]:
    """Only the Arrow IPC part: the group's table written as a stream and read back."""
    table, _ = group_to_table(group, run="b", prompt_id="p", worker="w")
    batch = table.to_batches()[0]

    def round_trip() -> object:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        return list(pa.ipc.open_stream(sink.getvalue()))

    return round_trip


def main() -> None:
    rng = np.random.default_rng(0)
    rows = []
    cases = (("8 x 4096, full rows", 4096, True), ("8 x 2k-4k, ragged", 4096, False), ("8 x 16k-32k, ragged", 32768, False))
    for label, seqlen, full in cases:
        group = make_group(rng, 8, seqlen, full)
        nbytes = sum(a.nbytes for a in group.values())
        fresh_s = best_of(fresh_copy(group), 7, 50)
        into_s = best_of(copy_into(group), 7, 50)
        copy_s = min(fresh_s, into_s)
        codec_s = best_of(round_trip(group), 7, 50)
        ipc_s = best_of(ipc_only(group), 7, 50)
        wire = len(encode_group(group, run="b", prompt_id="p", worker="w"))
        rows.append((label, nbytes, wire, nbytes / fresh_s / 1e9, nbytes / into_s / 1e9, nbytes / codec_s / 1e9,
                     copy_s / codec_s, copy_s / ipc_s))

    print(f"{'group':<22}{'tensor MB':>10}{'wire MB':>9}{'a.copy() GB/s':>15}{'copyto GB/s':>13}{'codec GB/s':>12}"
          f"{'ratio':>8}{'ipc ratio':>11}")
    for label, nbytes, wire, fresh_gbs, into_gbs, codec_gbs, ratio, ipc_ratio in rows:
        print(f"{label:<22}{nbytes / 1e6:>10.2f}{wire / 1e6:>9.2f}{fresh_gbs:>15.2f}{into_gbs:>13.2f}{codec_gbs:>12.2f}"
              f"{ratio:>8.2f}{ipc_ratio:>11.2f}")
    print("ratio = (encode+decode throughput) / (the faster copy's throughput) of the padded tensor bytes;"
          " target >= 0.3 for 8 x 4k")
    print("ipc ratio = the same for only writing and reading the Arrow stream of an already-built batch (no conversion)")
    figures = {
        "score": round(min(r[6] for r in rows[:2]), 3),
        "ratio_full": round(rows[0][6], 3),
        "ratio_ragged": round(rows[1][6], 3),
        "ratio_32k_ragged": round(rows[2][6], 3),
        "ipc_only_ratio_full": round(rows[0][7], 3),
        "ipc_only_ratio_ragged": round(rows[1][7], 3),
        "codec_gbs_full": round(rows[0][5], 3),
        "copy_gbs_full": round(max(rows[0][3], rows[0][4]), 3),
        "fresh_copy_gbs_full": round(rows[0][3], 3),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
