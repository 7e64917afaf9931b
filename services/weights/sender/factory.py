"""`make_weight_sync`: the one place a `WeightSync` is built from `weights.transport` (the trainer,
`jetrl replay` and, through the trainer's settings, `jetrl up`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from nats.aio.client import Client as NATS

from services.common.bus import Bus
from services.weights.sender.publisher import WeightPublisher
from services.weights.sender.settings import (
    BroadcastSync,
    ColocatedSync,
    NoSync,
    SharedDirSync,
    StoreSync,
    WeightSyncSettings,
)
from services.weights.sender.sync import DiskWeights, NoWeights, WeightSync


def make_weight_sync(s: WeightSyncSettings, nc: NATS, run: str, *, retry_s: float, announce_key: bytes = b"",
                     inference_keys: Callable[[], tuple[str, str]] = lambda: ("", ""), streamed: bool = True,
                     bus: Bus | None = None) -> WeightSync:
    """The transport `s` names. `retry_s`: how long a NATS call is retried through an outage;
    `announce_key`: signs the announcements; `inference_keys`: reads the keys shown to the servers
    (in-memory transports only); `streamed`: the training call can gather bucket by bucket (not with LoRA);
    `bus`: the replicas, declare and retry policy of the stream and bucket it declares (the service's;
    None: a lone local server)."""
    if isinstance(s, NoSync):
        return NoWeights()
    shared = s.dir if isinstance(s, SharedDirSync) else s.disk_dir if isinstance(s, ColocatedSync | BroadcastSync) else None
    disk = WeightPublisher(nc, run, shared_dir=shared, keep_last=s.keep_last, bus_retry_timeout_s=retry_s,
                           announce_key=announce_key, bus=bus)
    if isinstance(s, StoreSync | SharedDirSync):
        # the trainer hands each dir over
        return DiskWeights(functools.partial(disk.publish_dir, consume=True), retry_s=retry_s, retry=disk.bus.retry)
    return _in_memory(s, nc, run, disk, retry_s=retry_s, keys=inference_keys, streamed=streamed)


def _in_memory(s: ColocatedSync | BroadcastSync, nc: NATS, run: str, disk: WeightPublisher, *, retry_s: float,
               keys: Callable[[], tuple[str, str]], streamed: bool) -> WeightSync:
    from services.weights.sender.broadcast import WeightBroadcaster
    from services.weights.sender.broadcast_publish import BroadcastPublisher
    from services.weights.sender.colocated import ColocatedSender
    from services.weights.sender.memory import MemoryWeights
    from services.weights.sender.version_sender import VersionSender

    sender: VersionSender
    if isinstance(s, ColocatedSync):
        sender = ColocatedSender(s.servers, dtype=s.dtype, bucket_mb=s.bucket_mb, timeout_s=s.timeout_s, adopt=s.adopt, keys=keys())
    else:
        sender = WeightBroadcaster(s.servers, master_address=s.master_address, dtype=s.dtype, bucket_mb=s.bucket_mb,
                                   timeout_s=s.timeout_s, group_name=s.group_name, checksum=s.checksum, keys=keys())
    publisher = BroadcastPublisher(nc, run, sender, disk, s.disk_every, retry_s=retry_s, background=s.background,
                                   bus=disk.bus)
    return MemoryWeights(publisher, streamed=streamed, build_ahead_s=s.build_ahead_s)

