"""`MemoryWeights`: the `WeightSync` of the in-memory transports (colocated, broadcast).

Each version goes to the servers through a `BroadcastPublisher` (reports, announcement, the disk copy
every `disk_every` versions, the background send). Streamed (the default, unless LoRA's merged
weights need the whole state): the training call gathers the version bucket by bucket into the
stream `begin` opened, and the buckets go out as they come; otherwise the call returns the gathered
state and it is sent after the step.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from services.weights.sender.broadcast_publish import BroadcastPublisher
from services.weights.sender.bucket_stream import BucketStream, StreamSpec
from services.weights.sender.sync import Shipment

if TYPE_CHECKING:
    import torch

    from services.common.metrics import MetricsPublisher


class MemoryWeights:
    publishes = True

    def __init__(self, publisher: BroadcastPublisher, *, streamed: bool, build_ahead_s: float = 0.0) -> None:
        self.publisher = publisher
        self.streamed = streamed
        """Whether the training call can gather bucket by bucket (`services/trainer/gather.py`)."""
        self.build_ahead_s = build_ahead_s

    def begin(self, version: int, staging: Path) -> Shipment:
        return _MemoryShipment(self, version, str(staging / f"v{version}") if self.publisher.wants_disk(version) else None)

    async def publish_dir(self, version: int, step: int, hf_dir: Path) -> None:
        disk = self.publisher.disk
        if disk is None:
            raise RuntimeError("no disk publisher: this transport cannot publish a checkpoint directory")
        await disk.publish_dir(version, step, hf_dir, consume=True)

    async def prepare(self) -> None:
        if self.build_ahead_s > 0:  # the rendezvous overlaps the engine's build
            await self.publisher.build_ahead(self.build_ahead_s)

    async def aclose(self) -> None:
        await self.publisher.aclose()


class _MemoryShipment(Shipment):
    def __init__(self, owner: MemoryWeights, version: int, weights_dir: str | None) -> None:
        self.publisher, self.version, self.weights_dir = owner.publisher, version, weights_dir
        self.written: Path | None = None
        self.state: dict[str, torch.Tensor] | None = None
        if owner.streamed:
            sender = owner.publisher.broadcaster
            self.stream = StreamSpec(dtype=sender.dtype_name, bucket_bytes=sender.bucket_bytes)
            self.sink = self.publisher.open_stream(version)
        else:
            self.want_state = True

    def _sink(self) -> BucketStream:
        assert self.sink is not None
        return self.sink

    def abandon(self, error: BaseException) -> None:
        if self.sink is not None:
            self.publisher.abandon_stream(self._sink(), error)

    async def landed(self, hf_dir: Path | None, state: dict[str, torch.Tensor] | None) -> None:
        self.written, self.state = hf_dir, state
        if self.sink is not None:  # its checkpoint dir, before anything else can fail
            await self.publisher.hand_over(self._sink(), hf_dir)

    async def finish(self, metrics: MetricsPublisher | None) -> None:
        try:
            if self.sink is not None:
                await self.publisher.publish_stream()
            elif self.state is not None:
                await self.publisher.publish(self.version, self.state, self.written)
        finally:
            if self.written is not None:  # (taken over by then, unless nothing was sent)
                await asyncio.to_thread(shutil.rmtree, self.written, True)
