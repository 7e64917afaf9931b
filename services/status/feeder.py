"""The feeder part of `jetrl status`: what became of the dataset's rows, from the trainer's last
metrics event on the METRICS stream (its `feeder_*` counts): prompts issued, answered and in flight,
rows re-issued (stale groups among them, which are never charged to their row), and every dropped
row by cause."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from schemas.messages import MessageError, MetricsEvent, decode
from schemas.subjects import METRICS_STREAM, Subjects

DROP_PREFIX = "feeder_dropped_"


@dataclass
class FeederStatus:
    reported: bool = False
    """Whether the trainer has reported its feeder at all (no step yet, or no feeder: False)."""
    step: int | None = None
    issued: int = 0
    accepted: int = 0
    in_flight: int = 0
    reissued: int = 0
    stale: int = 0
    """Groups judged stale; their rows were re-issued, uncharged."""
    filtered: int = 0
    timed_out: int = 0
    dropped: int = 0
    dropped_by_cause: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


async def feeder_status(nc: NATS, run: str, timeout_s: float = 5.0) -> FeederStatus:
    """The feeder's counts in the trainer's last metrics event (an ephemeral consumer reading the last
    message of the trainer's metrics subject)."""
    js = nc.jetstream(timeout=timeout_s)
    try:
        sub = await js.pull_subscribe(
            Subjects(run).metrics("trainer"),
            stream=METRICS_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, mem_storage=True),
        )
    except NotFoundError:
        return FeederStatus()
    try:
        if not (await sub.consumer_info()).num_pending:
            return FeederStatus()
        try:
            [msg] = await sub.fetch(1, timeout=timeout_s)
        except TimeoutError:
            return FeederStatus()
    finally:
        await sub.unsubscribe()
    try:
        event = decode(MetricsEvent, msg.data)
    except MessageError:
        return FeederStatus()
    return from_values(event.values, event.step)


def from_values(values: dict[str, float], step: int | None = None) -> FeederStatus:
    if "feeder_issued" not in values:
        return FeederStatus(step=step)
    n = lambda key: int(values.get(f"feeder_{key}", 0.0))  # noqa: E731
    causes = {k.removeprefix(DROP_PREFIX): int(v) for k, v in sorted(values.items()) if k.startswith(DROP_PREFIX)}
    return FeederStatus(
        reported=True, step=step, issued=n("issued"), accepted=n("accepted"), in_flight=n("in_flight"),
        reissued=n("reissued"), stale=n("stale"), filtered=n("filtered"), timed_out=n("timed_out"),
        dropped=n("dropped"), dropped_by_cause=causes,
    )


def render_feeder(status: FeederStatus) -> str:
    if not status.reported:
        return "feeder\n  the trainer has not reported a feeder yet"
    lines = [
        f"feeder (trainer step {status.step})",
        f"  prompts: issued {status.issued}  trained {status.accepted}  in flight {status.in_flight}  filtered {status.filtered}",
        f"  re-issued {status.reissued}  (stale groups {status.stale}, re-issued uncharged; timed out {status.timed_out})",
    ]
    causes = ", ".join(f"{cause} {n}" for cause, n in status.dropped_by_cause.items() if n)
    lines.append(f"  dropped rows: {status.dropped}" + (f" ({causes})" if causes else ""))
    return "\n".join(lines)
