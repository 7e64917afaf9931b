"""Retrying NATS calls through a server restart (docs/design.md "Failure semantics": clients reconnect and
continue): the trainer's calls, the weight publisher's and agent's object-store transfers, the agent's
announcements and reports.

nats-py reconnects by itself; a call made meanwhile fails with a timeout or a reconnecting/no-servers
error, or JetStream answers 503 while it starts up again. Those are retried with capped, jittered
backoff until `give_up_after_s` has passed since the first failure; then `BusUnavailable` says so.
A closed connection (the client was shut down) and any other error are not retried. An error of the
caller's own that is a `TimeoutError` (an object chunk never acknowledged) is retried like any timeout.
A write JetStream refused for want of space (`storefull.py`), or one that timed out while the server's
health names streams it cannot write, is retried too, without a budget (space returns when a person
makes room, however long that takes; a stop still ends it), and logged at error level naming the stream.

What a service's retries share lives in its `RetryPolicy` (the `Bus` its entry point makes carries it):
the store alarm, the permissions violations, and the stop that ends them (`runner.supervise` binds its
own); nothing here is process-wide. `retry` is the same loop for what is no NATS outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

from services.common.logging import get_logger
from services.common.storefull import StoreAlarm, store_full

log = get_logger("bus.retry")

T = TypeVar("T")

INITIAL_BACKOFF_S = 0.2
MAX_BACKOFF_S = 5.0


class NoStreamLeader(ConnectionError):
    """A clustered stream answered from a replica while it has no leader (`streaminfo.py`): the answer
    may lack the newest messages, so the call is retried like an outage until a leader answers."""


_RETRYABLE: tuple[type[BaseException], ...] = (
    TimeoutError,  # includes nats.errors.TimeoutError and FlushTimeoutError
    nats.errors.UnexpectedEOF,  # the server went away mid-request
    nats.errors.NoServersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,  # JetStream not (yet) answering after a restart
    nats.js.errors.ServiceUnavailableError,  # 503
    NoStreamLeader,
)
_FATAL: tuple[type[BaseException], ...] = (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError)


def full_jitter(attempt: int, initial_s: float, max_s: float) -> float:
    """The wait before retry `attempt` (0-based): uniform in [0, min(max_s, initial_s * 2**attempt)]
    ("full jitter", as openai-python and AWS's architecture blog do it): the one backoff every retry
    loop of jetrl uses."""
    return random.uniform(0.0, min(max_s, initial_s * 2**attempt))


class BusUnavailable(ConnectionError):
    """NATS calls kept failing with retryable errors for longer than the retry budget (or the
    process is stopping while they fail)."""


class RetryPolicy:
    """What every retried NATS call of one service shares: its `alarm` (a timed-out write asks the
    server's health whether the store is full, `storefull.py`), the permissions violations its
    connections were told of, and the stop that ends the retries.
    Its `Bus` carries it (`Bus.of` makes it from `nats_monitor_url`); `RetryPolicy()`: no monitor
    address, no stop (a tool or a test)."""

    def __init__(self, alarm: StoreAlarm | None = None) -> None:
        self.alarm = alarm if alarm is not None else StoreAlarm()
        self.denials: deque[tuple[float, str]] = deque(maxlen=16)
        """Permissions violations the server reported to this service's clients (monotonic time, text;
        `bus.connect` records them): a request the user may not make is dropped, so the request itself
        only sees a timeout (`bus.js_api_call` then refuses to retry it)."""
        self.stopping: asyncio.Event | None = None
        """Once set (the service is stopping: `runner.supervise` binds its own), a failing NATS call is
        retried no more: `BusUnavailable` at once, so a stop with the bus gone ends within its deadline
        instead of waiting out `bus_retry_timeout_s`."""

    def denied_since(self, since: float) -> list[str]:
        """The JetStream API permissions violations reported at or after `since` (monotonic), oldest first."""
        return [text for at, text in self.denials if at >= since and "$js.api" in text.lower()]

    @property
    def stopped(self) -> bool:
        return self.stopping is not None and self.stopping.is_set()

    async def wait(self, delay_s: float) -> None:
        """The backoff itself, cut short by a stop (the next failure then gives up)."""
        if self.stopping is None:
            await asyncio.sleep(delay_s)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), delay_s)


def retryable(exc: BaseException) -> bool:
    return (isinstance(exc, _RETRYABLE) and not isinstance(exc, _FATAL)) or store_full(exc) is not None


class Backoff:
    """Consecutive failures of one kind of call: `failed` waits the next backoff or raises
    `BusUnavailable` once the budget is spent; `reset` after a success."""

    def __init__(self, what: str, give_up_after_s: float, on_retry: Callable[[BaseException], None] | None = None, *,
                 policy: RetryPolicy) -> None:
        self.what = what
        self.policy = policy
        self.give_up_after_s = give_up_after_s
        self.on_retry = on_retry
        """Called before each wait for a retry (e.g. to count retries in the service's metrics)."""
        self.attempt = 0
        self._since: float | None = None

    def reset(self) -> None:
        if self._since is not None:
            log.info("nats call succeeded again", what=self.what, attempts=self.attempt,
                     outage_s=round(time.monotonic() - self._since, 1))
        self.attempt, self._since = 0, None

    async def failed(self, exc: BaseException) -> None:
        """After a failed call: `exc` itself raised when no retry can help it (`retryable`), else the
        next backoff waited (or `BusUnavailable` once the budget is spent, or at a stop)."""
        if not retryable(exc):
            raise exc
        now = time.monotonic()
        if self.policy.stopped:
            raise BusUnavailable(f"{self.what}: stopping while NATS is unavailable ({self.attempt + 1} attempts): {exc!r}") from exc
        refused = store_full(exc)
        # a timeout: an outage, or a full store that does not answer; the server's health says which (the alarm logs it)
        full = refused is not None or (isinstance(exc, TimeoutError) and bool(await self.policy.alarm.after_timeout(self.what)))
        if self._since is None or full:  # a full store is no outage: waited for until space returns, however long
            self._since = now
        waited = now - self._since
        if waited >= self.give_up_after_s:
            raise BusUnavailable(f"{self.what}: NATS unavailable for {waited:.0f}s ({self.attempt + 1} attempts): {exc!r}") from exc
        delay = min(full_jitter(self.attempt, INITIAL_BACKOFF_S, MAX_BACKOFF_S), self.give_up_after_s - waited)
        self.attempt += 1
        if self.on_retry is not None:
            self.on_retry(exc)
        if refused is not None:
            log.error("the JetStream store is full: a write was refused; retrying until space returns (docs/security.md "
                      "\"A full disk\")", stream=refused or "unnamed", what=self.what, attempt=self.attempt, error=str(exc))
        elif not full:
            log.warning("nats call failed; retrying", what=self.what, attempt=self.attempt, delay_s=round(delay, 2), error=repr(exc))
        await self.policy.wait(delay)


async def with_retries(
    what: str, call: Callable[[], Awaitable[T]], give_up_after_s: float, on_retry: Callable[[BaseException], None] | None = None,
    *, policy: RetryPolicy,
) -> T:
    """`await call()`, again after each retryable failure, until it succeeds or the budget is spent
    (`BusUnavailable`); any other error is raised at once. `policy`: the service's (its `Bus.retry`)."""
    backoff = Backoff(what, give_up_after_s, on_retry, policy=policy)
    while True:
        try:
            result = await call()
        except Exception as exc:
            await backoff.failed(exc)
            continue
        backoff.reset()
        return result


async def retry(
    call: Callable[[], Awaitable[T]], *, when: Callable[[Exception], bool], budget_s: float | None = None,
    attempts: int | None = None, initial_s: float = INITIAL_BACKOFF_S, max_s: float = MAX_BACKOFF_S,
    on_retry: Callable[[Exception, int], None] | None = None,
) -> T:
    """`await call()`, again after each failure that `when` accepts, `full_jitter` apart, until it
    succeeds, or `budget_s` has passed since the first call, or `attempts` calls have failed: then the
    last error itself is raised (as is at once any error `when` refuses). `on_retry(exc, n)` before the
    wait for retry n (1-based). For retries that are not a NATS outage (a stop does not end them):
    those go through `with_retries`."""
    since = time.monotonic()
    attempt = 0
    while True:
        try:
            return await call()
        except Exception as exc:
            attempt += 1
            if not when(exc) or (budget_s is not None and time.monotonic() - since >= budget_s) or (
                    attempts is not None and attempt >= attempts):
                raise
            if on_retry is not None:
                on_retry(exc, attempt)
        await asyncio.sleep(full_jitter(attempt - 1, initial_s, max_s))
