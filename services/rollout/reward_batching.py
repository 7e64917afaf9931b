"""Coalesce the reward requests of one event-loop turn into one request to the reward service.

A rollout worker's groups are generated together (one batched `/generate` for the groups whose weights
arrived in the same turn), so they ask for their rewards in the same turn too: at 16 prompts a step,
16 requests of 8 items, each a NATS round trip, a message the reward service decodes, checks and hands
to its pool, and a reply. `CoalescingRewardClient` holds each `score` call until the end of its turn,
sends the calls that name the same function and limits as one request (at most `max_items` items), and
gives each caller its own results, in order. The workflow still calls `score` once per group and cannot
tell.

Errors stay the caller's. A combined request the service refuses (or one too large for NATS) is sent
again one call per request, so a call is refused only for its own sake (a service whose `max_items` is
below ours still scores every call it would have taken alone). When no reward service answers, every
call of the request gets that error: each alone would have waited as long for nobody.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from schemas.messages import RewardItem, RewardResult
from services.common.logging import get_logger
from services.reward.client import RewardClient, RewardRequestError
from services.rollout.turn_batch import fail, send_batch

log = get_logger("reward-client")


@dataclass
class _Call:
    items: list[RewardItem]
    future: asyncio.Future[list[RewardResult]]


@dataclass
class _Batch:
    calls: list[_Call] = field(default_factory=list)
    items: int = 0


class CoalescingRewardClient:
    """`RewardClient.score`, the calls of one turn sent as one request (module doc)."""

    def __init__(self, client: RewardClient, max_items: int = 1024) -> None:
        if max_items < 1:
            raise ValueError(f"reward_batch_max_items must be >= 1, got {max_items}")
        self.client = client
        self.max_items = max_items
        self._pending: dict[tuple[Any, ...], _Batch] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # strong references: a bare task may be collected
        self.requests = 0
        """Requests sent to the reward service (a refused combined one and its calls sent again each count)."""
        self.calls = 0
        """`score` calls made."""
        self.split = 0
        """Combined requests refused and sent again one call per request."""

    async def score(self, fn: str, items: list[RewardItem], timeout_s: float | None = None, *,
                    item_timeout_s: float | None = None) -> list[RewardResult]:
        """One result per item, in order: `RewardClient.score`, sent with the turn's other calls."""
        if not items:
            return []
        self.calls += 1
        key = (fn, timeout_s, item_timeout_s)
        batch = self._pending.get(key)
        if batch is not None and batch.items + len(items) > self.max_items:
            self._flush(key)
            batch = None
        loop = asyncio.get_running_loop()
        if batch is None:
            batch = self._pending[key] = _Batch()
            loop.call_soon(self._flush_if_pending, key, batch)  # after every task already runnable in this turn
        call = _Call(list(items), loop.create_future())
        batch.calls.append(call)
        batch.items += len(items)
        return await call.future

    def _flush_if_pending(self, key: tuple[Any, ...], batch: _Batch) -> None:
        if self._pending.get(key) is batch:  # not already sent for being full
            self._flush(key)

    def _flush(self, key: tuple[Any, ...]) -> None:
        calls = self._pending.pop(key).calls
        send_batch(self._tasks, self._send(key, calls), [c.future for c in calls])

    async def _send(self, key: tuple[Any, ...], calls: list[_Call]) -> None:
        fn, timeout_s, item_timeout_s = key
        self.requests += 1
        try:
            results = await self.client.score(fn, [i for c in calls for i in c.items], timeout_s, item_timeout_s=item_timeout_s)
        except RewardRequestError as exc:
            if len(calls) == 1:
                fail([c.future for c in calls], exc)
                return
            self.split += 1
            if self.split & (self.split - 1) == 0:  # 1st, 2nd, 4th, ...: a service refusing every batch does not flood the log
                log.warning("combined reward request refused; sending its calls one by one", fn=fn, calls=len(calls),
                            refused_batches=self.split, error=str(exc))
            await asyncio.gather(*(self._send(key, [c]) for c in calls if not c.future.done()))
            return
        except asyncio.CancelledError:
            for c in calls:
                c.future.cancel()
            raise
        except Exception as exc:  # no service answered: every caller gets the error
            fail([c.future for c in calls], exc)
            return
        at = 0
        for c in calls:
            if not c.future.done():
                c.future.set_result(results[at:at + len(c.items)])
            at += len(c.items)
