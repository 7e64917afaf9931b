"""What sending one version came to, shared by both in-memory senders (`broadcast.py`,
`colocated.py`): which servers serve it and why the others do not, its size and where the time went."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.weights.sender.bucket_stream import BucketSource, ListSource
from services.weights.sender.buckets import make_buckets

if TYPE_CHECKING:
    import torch

    from services.weights.sender.version_sender import VersionSender


@dataclass
class VersionResult:
    version: int
    loaded: list[str] = field(default_factory=list)
    """Servers that now serve the version."""
    failed: dict[str, str] = field(default_factory=dict)
    """Servers that do not, and why."""
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    rebuilds: int = 0
    stages: dict[str, float] = field(default_factory=dict)
    """Where the sender's time went: `bucketing_s` (cast and cut), `checksum_s` (all buckets,
    overlapped with sending), `send_s` (the broadcasts themselves, in the sending thread)."""
    held_peak_bytes: int = 0
    """The most gathered bytes rank 0 held at once for this version: the whole version when it was
    gathered in full, at most two buckets when streamed (`BucketStream`)."""

    def settle(self, servers: list[str], refused: dict[str, str]) -> None:
        """Every server that was sent the version serves it, except those in `refused` (with why)."""
        self.loaded = [s for s in servers if s not in refused]
        self.failed.update(refused)

    def timed(self, t0: float, source: BucketSource) -> VersionResult:
        """The send's time, counted from the first bucket there to send (a streamed version's source
        opens with the training call that gathers it: the wait for its gather is training time),
        and the most gathered bytes held at once."""
        self.seconds = time.perf_counter() - max(t0, source.ready_at or t0)
        self.held_peak_bytes = source.peak_bytes
        return self


async def send_gathered(sender: VersionSender, version: int, state: dict[str, torch.Tensor],
                        dtype: torch.dtype) -> VersionResult:
    """A version gathered in full: cut into buckets (in the served `dtype`), then sent as a stream."""
    t0 = time.perf_counter()
    buckets = await asyncio.to_thread(make_buckets, state, dtype, sender.bucket_bytes, checksum=False)
    bucketing_s = time.perf_counter() - t0
    result = await sender.send(version, ListSource(buckets))
    result.stages["bucketing_s"] = bucketing_s
    result.seconds += bucketing_s
    return result
