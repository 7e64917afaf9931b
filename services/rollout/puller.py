"""A standing pull on the shared prompt consumer: credit is asked for as episode slots free up, and
prompts arrive as the feeder publishes them, with no round trip per prompt.

`PullSubscription.fetch` costs a request and a status message per call, and when the queue is empty
(a worker waiting for the next step's prompts, most of a run) another request and status besides:
~0.7 messages in and out per prompt with two workers on the demo (measured with the server's /connz),
~10% of the bus's messages. Here one request asks for many prompts and stays at the server for
`expires_s`, so a prompt costs only its delivery.

Credit accounting: the server serves waiting requests oldest first and they all live equally long,
so each delivery is counted against the oldest live request, and a request ends when it is filled,
when its 408 (expired) status arrives, or `expires_s + grace` after it was sent (a request lost with
the connection sends no status). Counting can only err towards more prompts than asked for, never
fewer, and nothing is lost either way: a prompt is acked only by the worker loop, after its result.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

#: status codes the server sends on a pull request's inbox (no JetStream message)
STATUS_HEADER = "Status"
PENDING_HEADER = "Nats-Pending-Messages"
HEARTBEAT, NO_MESSAGES, EXPIRED, CONFLICT = "100", "404", "408", "409"


@dataclass
class _Request:
    remaining: int
    deadline: float


class Puller:
    def __init__(self, nc: NATS, stream: str, consumer: str, expires_s: float, grace_s: float = 0.5) -> None:
        self.nc = nc
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.inbox = nc.new_inbox()
        self.expires_s = expires_s
        self.grace_s = grace_s
        self.arrived: deque[Msg] = deque()
        """Prompts delivered and not yet taken by the worker loop."""
        self.wake = asyncio.Event()
        """Set when a prompt or a status arrives (the loop waits on it)."""
        self.requests_sent = 0
        self.refused: str | None = None
        """The server's reason when it ended the requests (409: consumer deleted, too many waiting
        requests...); the worker loop backs off, clears it and asks again."""
        self._requests: deque[_Request] = deque()
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.inbox, cb=self._on_msg)

    async def close(self) -> list[Msg]:
        """Stop receiving; returns the prompts delivered but never taken (the caller naks them)."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        left = list(self.arrived)
        self.arrived.clear()
        return left

    @property
    def outstanding(self) -> int:
        """Prompts asked for and not delivered yet."""
        return sum(r.remaining for r in self._requests)

    def next_deadline(self) -> float | None:
        return self._requests[0].deadline + self.grace_s if self._requests else None

    async def top_up(self, free: int, min_batch: int) -> None:
        """Ask for more prompts when `free` slots not covered by credit reach `min_batch` (or any,
        when nothing is asked for at all)."""
        self._expire(time.monotonic())
        want = free - self.outstanding - len(self.arrived)
        if want <= 0 or (want < min_batch and self._requests):
            return
        body = json.dumps({"batch": want, "expires": int(self.expires_s * 1e9)}).encode()
        await self.nc.publish(self.next_subject, body, reply=self.inbox)
        self._requests.append(_Request(want, time.monotonic() + self.expires_s))
        self.requests_sent += 1

    def _expire(self, now: float) -> None:
        while self._requests and self._requests[0].deadline + self.grace_s <= now:
            self._requests.popleft()

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get(STATUS_HEADER) if msg.headers else None
        if status is None:
            if self._requests:
                self._requests[0].remaining -= 1
                if self._requests[0].remaining <= 0:
                    self._requests.popleft()
            self.arrived.append(msg)
        elif status == EXPIRED and self._requests:
            self._requests.popleft()
        elif status in (NO_MESSAGES, CONFLICT):  # refused or ended by the server: ask afresh, after a backoff
            self._requests.clear()
            self.refused = f"{status} {msg.headers.get('Description', '') if msg.headers else ''}".strip()
        self.wake.set()
