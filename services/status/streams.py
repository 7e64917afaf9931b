"""The bus part of `jetrl status`: each stream's size, the run's consumers and their lag, prompts in
flight, and which workers are alive (their last METRICS event is recent).

While a cluster has lost its majority some of these get no answer (a timeout, a 503): each is named
in `unanswered` and the rest is still shown. A stream with no leader is answered by a surviving
replica from its own copy, which may be behind: it is shown, marked as such."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client as NATS

from schemas import metric_names as names
from schemas.subjects import PROMPTS_STREAM, TRAJECTORIES_STREAM, Subjects, stream_specs
from services.bus.permissions import OBJ_STREAM
from services.common.streaminfo import led
from services.status.answers import answered
from services.status.events import metrics_events


@dataclass
class ConsumerLag:
    stream: str
    name: str
    pending: int
    """Messages not yet delivered (the lag)."""
    ack_pending: int
    """Delivered and not yet acknowledged (in flight)."""
    redelivered: int


@dataclass
class Worker:
    service: str
    worker: str
    seconds_ago: float
    alive: bool
    counters: dict[str, float] = field(default_factory=dict)
    """A rollout worker's structured-output losses from its last event (`constrained_restarts_total`,
    `constraint_unmet_total`; schemas/metric_names.py)."""


@dataclass
class BusStatus:
    streams: dict[str, dict[str, int]] = field(default_factory=dict)
    """{stream: messages, bytes, max_bytes (-1: no cap), consumers, leaderless (1: a replica's own copy
    answered, no leader)}; the WEIGHTS bucket's OBJ_WEIGHTS too, once it exists."""
    store: dict[str, int] = field(default_factory=dict)
    """JetStream's file store on this server (the account's): used and max bytes (-1: no limit of the
    account's own); empty when the server does not say (a user not allowed `$JS.API.INFO`)."""
    consumers: list[ConsumerLag] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    unanswered: dict[str, str] = field(default_factory=dict)
    """What the bus did not answer ("stream PROMPTS", "consumer ...", "workers"): the error."""

    def as_dict(self) -> dict:
        return asdict(self)


async def bus_status(nc: NATS, run: str, timeout_s: float, alive_within_s: float) -> BusStatus:
    """Each part asked at once (during an outage each may wait `timeout_s` for nothing)."""
    js = nc.jetstream(timeout=timeout_s)
    subjects = Subjects(run)
    status = BusStatus()

    names = [spec.name for spec in stream_specs()] + [OBJ_STREAM]
    consumers = ((PROMPTS_STREAM, subjects.rollout_consumer), (TRAJECTORIES_STREAM, subjects.trainer_consumer))
    streams, lags, workers = await asyncio.gather(
        asyncio.gather(*(answered(f"stream {name}", js.stream_info(name), status.unanswered) for name in names)),
        asyncio.gather(*(answered(f"consumer {stream}/{name}", js.consumer_info(stream, name), status.unanswered)
                         for stream, name in consumers)),
        answered("workers", _workers(nc, subjects, timeout_s, alive_within_s), status.unanswered),
    )
    for name, info in zip(names, streams, strict=True):
        if info is not None:
            status.streams[name] = {"messages": info.state.messages, "bytes": info.state.bytes,
                                    "max_bytes": info.config.max_bytes if info.config.max_bytes is not None else -1,
                                    "consumers": info.state.consumer_count, "leaderless": int(not led(info))}
    status.store = await _store(js)
    for (stream, name), c in zip(consumers, lags, strict=True):
        if c is not None:
            status.consumers.append(ConsumerLag(stream, name, c.num_pending, c.num_ack_pending, c.num_redelivered))
    status.workers = workers or []
    return status


async def _workers(nc: NATS, subjects: Subjects, timeout_s: float, alive_within_s: float) -> list[Worker]:
    """Last metrics event per service subject, then per worker among them."""
    since = datetime.fromtimestamp(time.time() - max(alive_within_s * 4, 60), UTC)
    last: dict[tuple[str, str], float] = {}
    counters: dict[tuple[str, str], dict[str, float]] = {}
    for ev in await metrics_events(nc, subjects.metrics_all, timeout_s, since):
        key = (ev.service, ev.worker)
        if ev.time >= last.get(key, 0.0):
            last[key] = ev.time
            counters[key] = {k: ev.values[k] for k in names.CONSTRAINT_COUNTERS if k in ev.values}
    now = time.time()
    return [Worker(s, w, now - t, now - t <= alive_within_s, counters.get((s, w), {})) for (s, w), t in sorted(last.items())]


async def _store(js: Any) -> dict[str, int]:
    try:
        info = await js.account_info()
    except Exception:  # not allowed, or no answer: the streams above still say what each holds
        return {}
    return {"used": int(info.storage), "max": int(info.limits.max_storage) if info.limits.max_storage else -1}


def render_bus(status: BusStatus) -> str:
    lines = ["streams"]
    if status.store:
        cap = f" of {status.store['max'] / 1e6:.1f} MB" if status.store["max"] > 0 else ""
        lines[0] = f"streams (store: {status.store['used'] / 1e6:.1f} MB used{cap})"
    for name, s in status.streams.items():
        leaderless = "  NO LEADER: a replica's own copy, may be behind" if s.get("leaderless") else ""
        cap = f" of {s['max_bytes'] / 1e6:.1f} MB" if s.get("max_bytes", -1) > 0 else ""
        lines.append(f"  {name:<13} {s['messages']:>9} msgs {s['bytes'] / 1e6:>10.1f} MB{cap}  {s['consumers']} consumers{leaderless}")
    lines.append("consumers (pending = lag, ack pending = in flight)")
    if not status.consumers and not any(k.startswith("consumer ") for k in status.unanswered):
        lines.append("  none for this run yet")
    for c in status.consumers:
        lines.append(f"  {c.stream}/{c.name:<24} pending {c.pending:>6}  ack pending {c.ack_pending:>5}  redelivered {c.redelivered}")
    lines.append("workers (from their last metrics event)")
    if not status.workers and "workers" not in status.unanswered:
        lines.append("  none has reported")
    for w in status.workers:
        state = "alive" if w.alive else "SILENT"
        counted = "".join(f"  {k.removesuffix('_total').replace('_', ' ')} {v:.0f}" for k, v in w.counters.items())
        lines.append(f"  {w.service:<10} {w.worker or '-':<28} {state:<7} last seen {w.seconds_ago:.0f}s ago{counted}")
    for what, error in status.unanswered.items():
        lines.append(f"  NO ANSWER for {what}: {error}")
    return "\n".join(lines)
