"""`BroadcastPublisher`: the trainer's publish step when weights travel in memory.

After step v: broadcast the parameters to every live server (`WeightBroadcaster`), report each
server's outcome (`WeightsLoaded` / `WeightsLoadFailed`, transport `broadcast`: the trainer is the one
that saw every server's answer), announce `WeightsPublished{transport: broadcast, members, ...}`, and
every `disk_every` versions also publish the HF checkpoint through `WeightPublisher` (object store or
shared directory), where a server that joins late or missed versions catches up.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS

from schemas.messages import Message, WeightsLoaded, WeightsLoadFailed, WeightsPublished, encode
from schemas.subjects import Subjects
from services.common.busretry import BusUnavailable, with_retries
from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher
from services.weights.broadcast import VersionResult, WeightBroadcaster
from services.weights.publisher import WeightPublisher, ensure_weight_sync_stream
from services.weights.trust import sign

if TYPE_CHECKING:
    import torch

log = get_logger("weights.broadcast")


class BroadcastPublisher:
    def __init__(self, nc: NATS, run: str, broadcaster: WeightBroadcaster, disk: WeightPublisher | None, disk_every: int,
                 retry_s: float = 300.0) -> None:
        self.js = nc.jetstream()
        self.nc = nc
        self.run = run
        self.subjects = Subjects(run)
        self.broadcaster = broadcaster
        self.disk = disk
        self.disk_every = disk_every
        self.retry_s = retry_s
        """How long a NATS publish is retried through a server restart (the trainer's bus_retry_timeout_s)."""
        self.last_disk: WeightsPublished | None = None
        self.history: list[VersionResult] = []
        """Every version's outcome (for metrics and tests)."""
        self._ready = False
        self.metrics: MetricsPublisher | None = MetricsPublisher(nc, run, "weights_broadcast")

    def wants_disk(self, version: int) -> bool:
        """Whether version `version` is also written to disk / the object store."""
        return self.disk is not None and self.disk_every > 0 and version % self.disk_every == 0

    async def publish(self, version: int, state: dict[str, torch.Tensor], hf_dir: Path | None) -> WeightsPublished:
        if not self._ready:
            await ensure_weight_sync_stream(self.nc)
            if self.last_disk is None and self.disk is not None:
                self.last_disk = await self._latest_disk()
            self._ready = True
        result = await self.broadcaster.send_version(version, state)
        self.history.append(result)
        for server in result.loaded:
            await self._report(self.subjects.weights_loaded(server), WeightsLoaded(
                run=self.run, server=server, version=version, seconds=result.seconds, transport="broadcast"))
        for server, reason in result.failed.items():
            await self._report(self.subjects.weights_failed(server), WeightsLoadFailed(
                run=self.run, server=server, version=version, reason=reason, transport="broadcast"))
        disk = self.last_disk
        msg = WeightsPublished(
            run=self.run, version=version, step=version, transport="broadcast", members=result.loaded,
            group=self.broadcaster.address, dtype=self.broadcaster.dtype_name, buckets=result.buckets, bytes=result.bytes,
            uri=disk.uri if disk else "", files=list(disk.files) if disk else [], disk_version=disk.version if disk else None,
        )
        msg = sign(msg, self.disk.announce_key if self.disk is not None else b"")  # the agents check it
        data = encode(msg)
        await with_retries(f"announce weights v{version}", lambda: self.js.publish(self.subjects.weights_published, data), self.retry_s)
        if self.metrics is not None:
            await self.metrics.emit({
                "broadcast_seconds": result.seconds, "broadcast_bytes": float(result.bytes), "broadcast_buckets": float(result.buckets),
                "broadcast_members": float(len(result.loaded)), "broadcast_failed": float(len(result.failed)),
                "broadcast_rebuilds": float(result.rebuilds),
            }, step=version, version=version)
        log.info("weights broadcast", version=version, members=result.loaded, failed=list(result.failed),
                 seconds=round(result.seconds, 3), bytes=result.bytes, buckets=result.buckets, rebuilds=result.rebuilds)
        if hf_dir is not None and self.disk is not None:
            # after the broadcast: members already hold this version, so their agents skip the disk copy
            t0 = time.perf_counter()
            writer = self.disk

            async def publish_disk() -> WeightsPublished:
                if not await asyncio.to_thread(Path(hf_dir).is_dir):  # a failed attempt moved it before announcing
                    raise BusUnavailable(f"weights v{version}: {hf_dir} was taken over by a failed publish")
                return await writer.publish_dir(version, version, hf_dir, consume=True)

            self.last_disk = await with_retries(f"publish weights v{version}", publish_disk, self.retry_s)
            log.info("disk copy published", version=version, seconds=round(time.perf_counter() - t0, 3))
            return self.last_disk
        return msg

    async def _latest_disk(self) -> WeightsPublished | None:
        assert self.disk is not None
        latest = await self.disk.latest()
        if latest is None:
            return None
        if latest.transport == "disk":
            return latest
        if latest.disk_version is None:
            return None
        return latest.model_copy(update={"version": latest.disk_version, "transport": "disk", "members": []})

    async def _report(self, subject: str, message: Message) -> None:
        try:
            await self.js.publish(subject, encode(message))
        except Exception as exc:  # a lost report costs `jetrl status` a line, never the step
            log.warning("weights report lost", subject=subject, error=repr(exc))

    async def aclose(self) -> None:
        await self.broadcaster.aclose()
