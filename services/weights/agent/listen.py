"""The agent's view of the weight-sync subject, kept through NATS restarts.

It follows the subject through an ordered consumer from its last message on (a late joiner catches up
at once). A server restart loses that consumer; nats-py would only notice after two missed heartbeats
(~10 s) and announcements already stored meanwhile would wait for it. So as soon as the client has
reconnected, the last message of the subject is read from the stream (the stream keeps the last one
per subject) and offered if it is newer than anything seen, and the consumer is re-created right after
it. Every NATS call is retried while the bus is away, for as long as it is away: following the
subject is the agent's whole job, and there is nothing better to do meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from schemas.messages import MessageError, WeightsPublished, decode
from schemas.subjects import WEIGHT_SYNC_STREAM
from services.common.busretry import BusUnavailable, RetryPolicy, with_retries
from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher
from services.common.poison import terminate_poison

log = get_logger("weights.listen")

T = TypeVar("T")


class AnnouncementFeed:
    """Calls `offer` with each announcement newer (by stream sequence) than any offered before."""

    def __init__(self, nc: NATS, subject: str, offer: Callable[[WeightsPublished], None], metrics: MetricsPublisher,
                 retry_s: float, missing: Callable[[WeightsPublished], bool] = lambda _: False, *,
                 policy: RetryPolicy) -> None:
        """`policy`: the service's retry policy (`Bus.retry`)."""
        self.nc = nc
        self.policy = policy
        self.js = nc.jetstream()
        self.subject = subject
        self.offer = offer
        self.metrics = metrics
        self.retry_s = retry_s
        """Budget of one round of retries; a round that runs out is logged and a new one begins."""
        self.missing = missing
        """Whether a re-read announcement seen before must be offered again (its load never happened)."""
        self.last_seq = 0
        """Stream sequence of the newest announcement offered (live and re-read ones can cross)."""

    async def run(self, stopping: asyncio.Event) -> None:
        reconnects = self.nc.stats["reconnects"]
        sub = await self._subscribe(stopping)
        try:
            while not stopping.is_set():
                if self.nc.stats["reconnects"] != reconnects and self.nc.is_connected:
                    reconnects = self.nc.stats["reconnects"]
                    log.info("nats reconnected: re-reading the latest announcement")
                    self.metrics.count("resyncs")
                    await self.resync(stopping)
                    await _unsubscribe(sub)
                    sub = await self._subscribe(stopping)
                if sub is None:
                    break  # stopping while subscribing
                try:
                    msg = await sub.next_msg(timeout=0.25)
                except TimeoutError:
                    continue
                await self._on_message(msg)
        finally:
            await _unsubscribe(sub)

    async def resync(self, stopping: asyncio.Event) -> None:
        """Offer the stream's last announcement if it is newer than any offered."""
        try:
            raw = await self._patiently("read the latest announcement",
                                        lambda: self.js.get_last_msg(WEIGHT_SYNC_STREAM, self.subject), stopping)
        except NotFoundError:
            return  # nothing announced yet
        if raw is None:
            return
        try:
            announced = decode(WeightsPublished, raw.data or b"")
        except MessageError as exc:
            log.error("malformed latest announcement skipped", stream_seq=raw.seq, error=str(exc))
            self.metrics.count("malformed_messages")
            return
        if self.missing(announced) and (raw.seq or 0) <= self.last_seq:
            log.info("offering again the latest announcement, not loaded yet", version=announced.version)
            self.offer(announced)
            return
        self._offer(announced, raw.seq or 0)

    async def _subscribe(self, stopping: asyncio.Event) -> Any:
        if self.last_seq:  # from the first announcement not yet seen
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.last_seq + 1)
        else:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST)
        return await self._patiently(
            "follow the weight-sync subject",
            lambda: self.js.subscribe(self.subject, stream=WEIGHT_SYNC_STREAM, ordered_consumer=True, config=config),
            stopping,
        )

    async def _on_message(self, msg: Msg) -> None:
        try:
            announced = decode(WeightsPublished, msg.data)
        except MessageError as exc:
            with contextlib.suppress(Exception):  # the term is lost if the bus is away; nothing else is
                await terminate_poison(msg, exc, self.metrics)
            return
        self._offer(announced, msg.metadata.sequence.stream)

    def _offer(self, announced: WeightsPublished, seq: int) -> None:
        if seq <= self.last_seq:
            return  # seen already (re-read after a reconnect, or re-delivered by a new consumer)
        self.last_seq = seq
        self.offer(announced)

    async def _patiently(self, what: str, call: Callable[[], Awaitable[T]], stopping: asyncio.Event) -> T | None:
        """`call()` retried while the bus is away, however long; None if stopping meanwhile."""
        while not stopping.is_set():
            try:
                return await with_retries(what, call, self.retry_s, on_retry=lambda _: self.metrics.count("bus_retries"),
                                          policy=self.policy)
            except BusUnavailable as exc:
                log.error("nats still unavailable; still trying", what=what, error=str(exc))
        return None


async def _unsubscribe(sub: Any) -> None:
    if sub is not None:
        with contextlib.suppress(Exception):  # fails while the bus is away; the server drops the consumer
            await sub.unsubscribe()
