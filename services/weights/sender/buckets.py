"""Buckets of a broadcast version: the parameters in the served dtype, in order, cut into pieces of
about `bucket_mb`, each with its checksum (`bucket_checksum.py`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from schemas.bucket_checksum import bucket_checksum


@dataclass
class Bucket:
    names: list[str]
    tensors: list[torch.Tensor]
    checksum: str
    checksum_s: float = 0.0
    """How long computing the checksum took (for the stage breakdown)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """The indices of `sizes` (bytes per tensor, in order) cut into buckets of about `bucket_bytes`: a
    tensor that would make a bucket larger starts the next one; a larger tensor is a bucket of its own.
    The one rule of both the in-memory bucketing and the trainer's bucket-by-bucket gather, which every
    rank computes for itself."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(sizes):
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def make_buckets(state: dict[str, torch.Tensor], dtype: torch.dtype, bucket_bytes: int, *, checksum: bool = True) -> list[Bucket]:
    """The parameters in `dtype`, in order, cut into buckets of about `bucket_bytes` (`plan_buckets`).
    checksum=False leaves each bucket's checksum to be computed later (`WeightBroadcaster` computes
    bucket n+1's while bucket n is on the wire)."""
    names = list(state)
    tensors = [state[n].detach().to(dtype).contiguous() for n in names]
    plan = plan_buckets([t.numel() * t.element_size() for t in tensors], bucket_bytes)
    out = []
    for idx in plan:
        part = [tensors[i] for i in idx]
        out.append(Bucket([names[i] for i in idx], part, bucket_checksum(part) if checksum else ""))
    return out


async def ensure_checksum(bucket: Bucket) -> None:
    """Compute the bucket's checksum (in a thread) unless it has one."""
    if not bucket.checksum:
        t0 = time.perf_counter()
        bucket.checksum = await asyncio.to_thread(bucket_checksum, bucket.tensors)
        bucket.checksum_s = time.perf_counter() - t0
