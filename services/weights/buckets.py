"""Buckets of a broadcast version: the parameters in the served dtype, in order, cut into pieces of
about `bucket_mb`, each with its checksum (`bucket_checksum.py`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from services.weights.bucket_checksum import bucket_checksum


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


def make_buckets(state: dict[str, torch.Tensor], dtype: torch.dtype, bucket_bytes: int, *, checksum: bool = True) -> list[Bucket]:
    """The parameters in `dtype`, in order, cut into buckets of about `bucket_bytes` (a larger tensor
    is a bucket of its own). checksum=False leaves each bucket's checksum to be computed later
    (`WeightBroadcaster` computes bucket n+1's while bucket n is on the wire)."""
    buckets: list[Bucket] = []
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    size = 0
    for name, t in state.items():
        t = t.detach().to(dtype).contiguous()
        if tensors and size + t.numel() * t.element_size() > bucket_bytes:
            buckets.append(Bucket(names, tensors, bucket_checksum(tensors) if checksum else ""))
            names, tensors, size = [], [], 0
        names.append(name)
        tensors.append(t)
        size += t.numel() * t.element_size()
    if tensors:
        buckets.append(Bucket(names, tensors, bucket_checksum(tensors) if checksum else ""))
    return buckets


async def ensure_checksum(bucket: Bucket) -> None:
    """Compute the bucket's checksum (in a thread) unless it has one."""
    if not bucket.checksum:
        t0 = time.perf_counter()
        bucket.checksum = await asyncio.to_thread(bucket_checksum, bucket.tensors)
        bucket.checksum_s = time.perf_counter() - t0
