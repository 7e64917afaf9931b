"""`BroadcastPublisher`: the trainer's publish step when weights travel in memory.

After step v: broadcast the parameters to every live server (`WeightBroadcaster`), report each
server's outcome (`WeightsLoaded` / `WeightsLoadFailed`, transport `broadcast`: the trainer is the one
that saw every server's answer), announce `WeightsPublished{transport: broadcast, members, ...}`, and
every `disk_every` versions also publish the HF checkpoint through `WeightPublisher` (object store or
shared directory), where a server that joins late or missed versions catches up.

With `background` (the default), a version without a disk copy is sent while the trainer goes on
with its next step: `publish` returns at once and the next `publish` (or `wait`, or `aclose`) first
waits for it to be done, so versions still go out one at a time, in order, and a failure (NATS
away past the retry deadline) is raised there. A version with a disk copy is published in full
before `publish` returns: the trainer deletes its checkpoint directory right after.

Streamed (the trainer's default, `services/trainer/model/gather.py`): `open_stream(v)` before the training
call returns the `BucketStream` rank 0's gather fills bucket by bucket inside that call; a task sends
each bucket as it comes (once the version before is done). Right after the call `hand_over(stream,
hf_dir)` gives it the checkpoint directory (disk versions; `abandon_stream` instead when the call
failed); later in the step `publish_stream()` waits for the version before, as `publish` does.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS

from schemas.messages import Message, WeightsLoaded, WeightsLoadFailed, WeightsPublished, encode
from schemas.subjects import Subjects
from services.common.bus import Bus
from services.common.busretry import BusUnavailable, with_retries
from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher
from services.weights.sender.bucket_stream import BucketStream, StreamClosed
from services.weights.sender.publisher import WeightPublisher, ensure_weight_sync_stream, next_epoch
from services.weights.sender.results import VersionResult
from services.weights.sender.version_sender import VersionSender
from services.weights.trust import sign

if TYPE_CHECKING:
    import torch

log = get_logger("weights.broadcast")


class BroadcastPublisher:
    def __init__(self, nc: NATS, run: str, broadcaster: VersionSender, disk: WeightPublisher | None, disk_every: int,
                 retry_s: float = 300.0, background: bool = True, bus: Bus | None = None) -> None:
        self.js = nc.jetstream()
        self.bus = bus if bus is not None else Bus()
        """Replicas, declare and retry policy of the WEIGHT_SYNC stream it declares (the trainer's `Bus`)."""
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
        self.epoch = 0
        """This trainer's epoch (`publisher.next_epoch`), shared with the disk publisher."""
        self.background = background
        self._pending: asyncio.Task[WeightsPublished] | None = None
        """The version being sent in the background, if any."""
        self._opened: tuple[BucketStream, asyncio.Task[WeightsPublished], asyncio.Future[Path | None]] | None = None
        """The stream opened for the training call under way, its sending task, and its checkpoint dir to come."""
        self._before: asyncio.Task[WeightsPublished] | None = None
        """The version before the one handed over last, for `publish_stream` to wait for."""
        self.metrics: MetricsPublisher | None = MetricsPublisher(nc, run, "weights_broadcast")

    def wants_disk(self, version: int) -> bool:
        """Whether version `version` is also written to disk / the object store."""
        return self.disk is not None and self.disk_every > 0 and version % self.disk_every == 0

    async def publish(self, version: int, state: dict[str, torch.Tensor], hf_dir: Path | None) -> WeightsPublished | None:
        """Send `version` (and publish `hf_dir`, its checkpoint, when given); in the background
        (returns None) when `background` is on. Waits first for the version before it."""
        await self.wait()
        if not self.background:
            return await self._publish(version, state, hf_dir)
        # the caller deletes hf_dir once this returns: the background publish takes it over first
        owned = await asyncio.to_thread(_take_over, hf_dir) if hf_dir is not None else None
        self._pending = asyncio.create_task(self._publish_owned(version, state, owned), name=f"broadcast v{version}")
        return None

    async def _publish_owned(self, version: int, state: dict[str, torch.Tensor], hf_dir: Path | None) -> WeightsPublished:
        try:
            return await self._publish(version, state, hf_dir)
        finally:
            if hf_dir is not None:
                await asyncio.to_thread(shutil.rmtree, hf_dir, True)

    async def wait(self) -> WeightsPublished | None:
        """Until the version sent in the background (if any) is done; raises what it raised."""
        task, self._pending = self._pending, None
        return await task if task is not None else None

    # ---- streamed: the trainer's gather hands each bucket over as it is gathered ----------------
    def open_stream(self, version: int) -> BucketStream:
        """Before the training call of `version`: the stream its gather fills (rank 0's sink). Its
        buckets are sent as they come, once the version before is done."""
        loop = asyncio.get_running_loop()
        stream = BucketStream(loop)
        handed: asyncio.Future[Path | None] = loop.create_future()
        task = asyncio.create_task(self._send_stream(self._pending, version, stream, handed), name=f"broadcast v{version}")
        self._opened = (stream, task, handed)
        return stream

    async def hand_over(self, stream: BucketStream, hf_dir: Path | None) -> None:
        """Right after the training call: the version's checkpoint directory (disk versions), taken
        over at once since the trainer deletes it afterwards; the sending task publishes it after
        the broadcast."""
        task, handed = self._take(stream)
        self._before, self._pending = self._pending, task
        owned: Path | None = None
        try:
            owned = await asyncio.to_thread(_take_over, hf_dir) if hf_dir is not None else None
        finally:
            handed.set_result(owned)

    async def publish_stream(self) -> WeightsPublished | None:
        """After `hand_over`: wait for the version before (raising what it raised), as `publish` does;
        without `background` also for this one."""
        prev, self._before = self._before, None
        if prev is not None:
            await prev
        return await self.wait() if not self.background else None

    def abandon_stream(self, stream: BucketStream, error: BaseException) -> None:
        """The training call failed: nothing more of this version comes (what was sent is dropped by
        the members when the group is rebuilt)."""
        task, handed = self._take(stream)
        stream.close(error)
        if not handed.done():
            handed.set_result(None)
        prev, self._pending = self._pending, task
        if prev is not None:  # awaited by this version's task; its error, if any, is logged there
            prev.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _take(self, stream: BucketStream) -> tuple[asyncio.Task[WeightsPublished], asyncio.Future[Path | None]]:
        if self._opened is None or self._opened[0] is not stream:
            raise RuntimeError("publish_stream / abandon_stream without the matching open_stream")
        _, task, handed = self._opened
        self._opened = None
        return task, handed

    async def _send_stream(self, prev: asyncio.Task[WeightsPublished] | None, version: int, stream: BucketStream,
                           handed: asyncio.Future[Path | None]) -> WeightsPublished:
        hf_dir: Path | None = None
        try:
            await self._prepare()
            if prev is not None:
                await asyncio.wait([prev])  # its error is raised to the trainer by publish_stream
                if prev.cancelled() or prev.exception() is not None:
                    raise StreamClosed(f"version {version} not sent: the version before failed")
            result = await self.broadcaster.send(version, stream)
            hf_dir = await handed
            return await self._announce(version, result, hf_dir)
        finally:
            stream.finish()  # the gather never waits for a sender that is gone
            hf_dir = hf_dir or await handed
            if hf_dir is not None:
                await asyncio.to_thread(shutil.rmtree, hf_dir, True)

    # ---- one version ---------------------------------------------------------------------------
    async def _prepare(self) -> None:
        if not self._ready:
            await ensure_weight_sync_stream(self.nc, self.retry_s, bus=self.bus)
            if self.last_disk is None and self.disk is not None:
                self.last_disk = await self._latest_disk()
            # one epoch for the broadcast and the disk announcements: the disk publisher's, if any
            self.epoch = await with_retries("read the last announcement", lambda: next_epoch(self.nc, self.run), self.retry_s,
                                            policy=self.bus.retry)
            if self.disk is not None:
                self.epoch = self.disk.epoch = self.disk.epoch or self.epoch
            self._ready = True

    async def _publish(self, version: int, state: dict[str, torch.Tensor], hf_dir: Path | None) -> WeightsPublished:
        await self._prepare()
        result = await self.broadcaster.send_version(version, state)
        return await self._announce(version, result, hf_dir)

    async def _announce(self, version: int, result: VersionResult, hf_dir: Path | None) -> WeightsPublished:
        """Report every server's outcome, announce the version, publish its disk copy (`hf_dir`)."""
        self.history.append(result)
        how = self.broadcaster.transport
        reports = [self._report(self.subjects.weights_loaded(server), WeightsLoaded(
            run=self.run, server=server, version=version, seconds=result.seconds, transport=how)) for server in result.loaded]
        reports += [self._report(self.subjects.weights_failed(server), WeightsLoadFailed(
            run=self.run, server=server, version=version, reason=reason, transport=how))
            for server, reason in result.failed.items()]
        disk = self.last_disk
        msg = WeightsPublished(
            run=self.run, version=version, step=version, transport=how, members=result.loaded,
            group=self.broadcaster.address, dtype=self.broadcaster.dtype_name, buckets=result.buckets, bytes=result.bytes,
            uri=disk.uri if disk else "", files=list(disk.files) if disk else [], disk_version=disk.version if disk else None,
            epoch=self.epoch,
        )
        msg = sign(msg, self.disk.announce_key if self.disk is not None else b"")  # the agents check it
        data = encode(msg)
        # the reports and the announcement at once: each is a round trip to JetStream
        await asyncio.gather(
            with_retries(f"announce weights v{version}", lambda: self.js.publish(self.subjects.weights_published, data), self.retry_s,
                         policy=self.bus.retry),
            *reports)
        if self.metrics is not None:
            await self.metrics.emit({
                "broadcast_seconds": result.seconds, "broadcast_bytes": float(result.bytes), "broadcast_buckets": float(result.buckets),
                "broadcast_members": float(len(result.loaded)), "broadcast_failed": float(len(result.failed)),
                "broadcast_rebuilds": float(result.rebuilds), "broadcast_held_peak_bytes": float(result.held_peak_bytes),
            }, step=version, version=version)
        log.info("weights broadcast", transport=how, version=version, members=result.loaded, failed=list(result.failed),
                 seconds=round(result.seconds, 3), bytes=result.bytes, buckets=result.buckets, rebuilds=result.rebuilds)
        if hf_dir is not None and self.disk is not None:
            # after the broadcast: members already hold this version, so their agents skip the disk copy
            t0 = time.perf_counter()
            writer = self.disk

            async def publish_disk() -> WeightsPublished:
                if not await asyncio.to_thread(Path(hf_dir).is_dir):  # a failed attempt moved it before announcing
                    raise BusUnavailable(f"weights v{version}: {hf_dir} was taken over by a failed publish")
                return await writer.publish_dir(version, version, hf_dir, consume=True)

            self.last_disk = await with_retries(f"publish weights v{version}", publish_disk, self.retry_s, policy=self.bus.retry)
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

    async def build_ahead(self, wait_s: float) -> None:
        """The group built before the first version (`WeightBroadcaster.build_ahead`); a failure here
        is only logged: the first version builds the group as it always can."""
        try:
            members = await self.broadcaster.build_ahead(wait_s)
        except Exception as exc:
            log.warning("building the weight-update group ahead of the first version failed", error=repr(exc))
            return
        log.info("weight-update group ready before the first version", members=members)

    async def aclose(self) -> None:
        try:
            await self.wait()  # the last version still reaches the servers and is announced
        except Exception as exc:  # closing: the version is lost, not the shutdown
            log.warning("last weights version not published", error=repr(exc))
        await self.broadcaster.aclose()


def _take_over(hf_dir: Path) -> Path:
    """Move the trainer's checkpoint directory aside (a rename: same directory), for the background
    publish to own and delete."""
    hf_dir = Path(hf_dir)
    owned = hf_dir.with_name(f".{hf_dir.name}.publishing")
    shutil.rmtree(owned, ignore_errors=True)
    hf_dir.rename(owned)
    return owned
