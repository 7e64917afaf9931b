"""The run's weight announcements, read and declared by both sides: the WEIGHT_SYNC stream, the last
`WeightsPublished` and the epoch a trainer starting now announces with."""

from __future__ import annotations

import time
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from schemas.messages import MessageError, WeightsPublished, decode
from schemas.subjects import WEIGHT_SYNC_STREAM, Subjects, stream_specs
from services.common.bus import DECLARE_BUDGET_S, Bus


async def ensure_weight_sync_stream(nc: NATS, budget_s: float = DECLARE_BUDGET_S,
                                    on_retry: Callable[[BaseException], None] | None = None, *, bus: Bus | None = None) -> None:
    """Declare the WEIGHT_SYNC stream (idempotent) with `bus`'s replicas and declare policy, so publisher
    and agents can start in any order; a bus that does not answer is waited out for `budget_s` (the
    caller's `bus_retry_timeout_s`; `bus` None: a lone local server)."""
    bus = bus if bus is not None else Bus()
    specs = [s for s in stream_specs() if s.name == WEIGHT_SYNC_STREAM]
    await bus.declare_streams(nc.jetstream(), specs, budget_s=budget_s, on_retry=on_retry)


async def latest_published(nc: NATS, run: str) -> WeightsPublished | None:
    """The last announcement of the run (the stream keeps the last message per subject), or None."""
    try:
        msg = await nc.jetstream().get_last_msg(WEIGHT_SYNC_STREAM, Subjects(run).weights_published)
    except NotFoundError:
        return None
    return decode(WeightsPublished, msg.data or b"")  # no payload: a MessageError like any bad one


async def next_epoch(nc: NATS, run: str) -> int:
    """The epoch of a trainer starting now: one above the run's last announced epoch, and at least
    the Unix time (so it still grows should the stream have lost that announcement)."""
    try:
        last = await latest_published(nc, run)
    except MessageError:
        last = None  # a malformed last announcement: the time alone
    return max((last.epoch + 1) if last else 0, int(time.time()))
