"""The weights part of `jetrl status`: read the last message of every weight-sync subject of a run."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from schemas.messages import MessageError, WeightsLoaded, WeightsLoadFailed, WeightsPublished, decode
from schemas.subjects import WEIGHT_SYNC_STREAM, Subjects


@dataclass
class ServerWeights:
    server: str
    loaded_version: int | None = None
    loaded_at: float | None = None
    load_seconds: float | None = None
    lag: int | None = None
    """Published versions the server is behind (None before its first load)."""
    transport: str = ""
    """How its loaded version arrived: disk (fetched and loaded) or broadcast (in memory)."""
    last_failure: str = ""
    failed_version: int | None = None
    failed_at: float | None = None


@dataclass
class WeightsStatus:
    run: str
    published_version: int | None = None
    published_step: int | None = None
    published_at: float | None = None
    uri: str = ""
    transport: str = ""
    """How the last published version travelled: disk or broadcast."""
    members: int = 0
    """broadcast: servers that received the last version."""
    disk_version: int | None = None
    """broadcast: the version of the latest disk copy (where late joiners catch up)."""
    servers: list[ServerWeights] = field(default_factory=list)
    malformed: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


async def weights_status(nc: NATS, run: str, timeout_s: float = 5.0) -> WeightsStatus:
    """The last announcement and each server's last load / failure report."""
    subjects = Subjects(run)
    status = WeightsStatus(run=run)
    servers: dict[str, ServerWeights] = {}
    for msg in await _last_per_subject(nc, f"jetrl.{run}.weights.>", timeout_s):
        try:
            if msg.subject == subjects.weights_published:
                pub = decode(WeightsPublished, msg.data)
                status.published_version, status.published_step = pub.version, pub.step
                status.published_at, status.uri = pub.published_at, pub.uri
                status.transport, status.members = pub.transport, len(pub.members)
                status.disk_version = pub.version if pub.transport == "disk" else pub.disk_version
            elif msg.subject.startswith(f"jetrl.{run}.weights.loaded."):
                loaded = decode(WeightsLoaded, msg.data)
                s = servers.setdefault(loaded.server, ServerWeights(loaded.server))
                s.loaded_version, s.loaded_at, s.load_seconds = loaded.version, loaded.loaded_at, loaded.seconds
                s.transport = loaded.transport
            elif msg.subject.startswith(f"jetrl.{run}.weights.failed."):
                failed = decode(WeightsLoadFailed, msg.data)
                s = servers.setdefault(failed.server, ServerWeights(failed.server))
                s.last_failure, s.failed_version, s.failed_at = failed.reason, failed.version, failed.failed_at
        except MessageError:
            status.malformed += 1
    for s in servers.values():
        if status.published_version is not None and s.loaded_version is not None:
            s.lag = status.published_version - s.loaded_version
    status.servers = sorted(servers.values(), key=lambda s: s.server)
    return status


async def _last_per_subject(nc: NATS, subject: str, timeout_s: float, stream: str = WEIGHT_SYNC_STREAM) -> list[Msg]:
    """Every subject's last message (an ephemeral pull consumer, no acks), read until none pend."""
    js = nc.jetstream(timeout=timeout_s)
    try:
        sub = await js.pull_subscribe(
            subject,
            stream=stream,
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, mem_storage=True),
        )
    except NotFoundError:
        return []  # no stream yet: nothing was ever published
    out: list[Msg] = []
    try:
        pending = (await sub.consumer_info()).num_pending or 0
        while len(out) < pending:
            try:
                out.extend(await sub.fetch(min(256, pending - len(out)), timeout=timeout_s))
            except TimeoutError:
                break
    finally:
        await sub.unsubscribe()
    return out


def render_weights(status: WeightsStatus, now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = [f"weights (run {status.run})"]
    if status.published_version is None:
        lines.append("  published: nothing yet")
    else:
        where = status.uri
        if status.transport in ("broadcast", "colocated"):
            disk = "none yet" if status.disk_version is None else f"v{status.disk_version} {status.uri}"
            how = "by broadcast" if status.transport == "broadcast" else "in shared memory"
            where = f"{how} to {status.members} server(s); latest disk copy {disk}"
        lines.append(
            f"  published: v{status.published_version} (step {status.published_step}, {_ago(now, status.published_at)}) {where}"
        )
    if not status.servers:
        lines.append("  servers:   none has reported")
    width = max((len(s.server) for s in status.servers), default=0)
    for s in status.servers:
        loaded = "-" if s.loaded_version is None else f"v{s.loaded_version}"
        lag = "?" if s.lag is None else str(s.lag)
        line = f"  {s.server:<{width}}  loaded {loaded:<6} lag {lag:<3}"
        if s.loaded_at is not None:
            line += f" ({_ago(now, s.loaded_at)}, {s.transport or 'disk'}, took {s.load_seconds:.2f}s)"
        if s.failed_at is not None and (s.loaded_at is None or s.failed_at > s.loaded_at):
            line += f"  LAST LOAD FAILED v{s.failed_version}: {s.last_failure}"
        lines.append(line)
    if status.malformed:
        lines.append(f"  ({status.malformed} malformed message(s) skipped)")
    return "\n".join(lines)


def _ago(now: float, then: float | None) -> str:
    if then is None:
        return "?"
    secs = max(0.0, now - then)
    return f"{secs:.0f}s ago" if secs < 120 else f"{secs / 60:.0f}m ago"
