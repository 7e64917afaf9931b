"""Reading the METRICS stream for `jetrl status`: every event on a subject from a start point, through
a throwaway in-memory consumer that acknowledges nothing (status only reads)."""

from __future__ import annotations

from datetime import datetime

from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from schemas.messages import MessageError, MetricsEvent, decode
from schemas.subjects import METRICS_STREAM


async def metrics_events(nc: NATS, subject: str, timeout_s: float, since: datetime | None = None) -> list[MetricsEvent]:
    """The METRICS events on `subject` (a wildcard is fine), oldest first, from `since` (None: all
    kept); none if the stream does not exist. An undecodable event is skipped: status shows what it
    can read, and the publishers' own checks count what they refused."""
    js = nc.jetstream(timeout=timeout_s)
    start = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, mem_storage=True)
    if since is not None:
        start.deliver_policy, start.opt_start_time = DeliverPolicy.BY_START_TIME, since
    try:
        sub = await js.pull_subscribe(subject, stream=METRICS_STREAM, config=start)
    except NotFoundError:
        return []
    events: list[MetricsEvent] = []
    try:
        pending = (await sub.consumer_info()).num_pending or 0
        seen = 0
        while seen < pending:
            try:
                msgs = await sub.fetch(min(512, pending - seen), timeout=timeout_s)
            except TimeoutError:
                break
            seen += len(msgs)
            for msg in msgs:
                try:
                    events.append(decode(MetricsEvent, msg.data))
                except MessageError:
                    continue
    finally:
        await sub.unsubscribe()
    return events
