"""The supervised asyncio runner every service uses.

- Every background task is named and started through `Supervisor.spawn`; if one dies with an error,
  the service fails fast with that error.
- SIGTERM/SIGINT set `supervisor.stopping`; tasks are expected to notice and finish their work; the
  whole stop has `shutdown_timeout_s`: tasks get TASKS_SHARE of it (a task waiting on a bus that is
  gone never finishes by itself), then whatever is still running is cancelled.
- Resources live in an `AsyncExitStack` (`supervisor.stack`) and are closed in reverse order, in what
  is left of the deadline but a second (for the process's own connection close).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from services.common.busretry import RetryPolicy
from services.common.logging import get_logger

log = get_logger("runner")
TASKS_SHARE = 0.6
"""Of `shutdown_timeout_s`, what the tasks get to finish after a stop; the rest is for cancelling
them and closing resources."""


class ServiceFailed(RuntimeError):
    """A supervised task died; `__cause__` is its error."""


class Supervisor:
    def __init__(self, name: str, shutdown_timeout_s: float = 20.0) -> None:
        self.name = name
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stopping = asyncio.Event()
        self.stack = contextlib.AsyncExitStack()
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._failure: BaseException | None = None
        self._failed_task: str | None = None
        self._deadline: float | None = None

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        if name in self._tasks and not self._tasks[name].done():
            raise ValueError(f"task {name!r} is already running")
        task = asyncio.create_task(coro, name=name)
        self._tasks[name] = task
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._failure is None:
            self._failure = exc
            self._failed_task = task.get_name()
            log.error("task failed", task=task.get_name(), error=repr(exc), exc_info=exc)
            self.stopping.set()

    def stop(self) -> None:
        self.stopping.set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless stopping; True if the service is stopping."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)
        return self.stopping.is_set()

    def left(self) -> float:
        """Seconds left of the stop's deadline (before a stop: half the timeout)."""
        if self._deadline is None:
            return self.shutdown_timeout_s / 2
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def wait(self) -> None:
        """Wait for a stop request or a task failure, then give tasks their share of the deadline."""
        await self.stopping.wait()
        self._deadline = asyncio.get_running_loop().time() + self.shutdown_timeout_s
        pending = [t for t in self._tasks.values() if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=self.shutdown_timeout_s * TASKS_SHARE)
            for t in still:
                log.warning("task did not finish before the deadline; cancelling", task=t.get_name())
                t.cancel()
            if still:
                await asyncio.wait(still, timeout=min(2.0, self.left() / 2))

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise ServiceFailed(f"{self.name}: task {self._failed_task!r} failed: {self._failure!r}") from self._failure


def install_signal_handlers(supervisor: Supervisor) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, _on_signal, supervisor, sig)


def _on_signal(supervisor: Supervisor, sig: signal.Signals) -> None:
    log.info("signal received; draining", signal=sig.name)
    supervisor.stop()


async def supervise(
    name: str,
    main: Callable[[Supervisor], Awaitable[None]],
    shutdown_timeout_s: float = 20.0,
    handle_signals: bool = True,
    retry: RetryPolicy | None = None,
) -> None:
    """Run `main(supervisor)` (which spawns tasks and may return at once), until a signal, a task
    failure, or every task finishing. Resources in `supervisor.stack` are closed within the deadline.
    `retry`: the service's retry policy (its `Bus.retry`), whose retries a stop ends at once."""
    sup = Supervisor(name, shutdown_timeout_s)
    before = retry.stopping if retry is not None else None
    if retry is not None:
        retry.stopping = sup.stopping  # a stop with the bus gone gives up the NATS retries at once
    if handle_signals:
        install_signal_handlers(sup)
    try:
        await main(sup)
        waiter = asyncio.create_task(_all_done(sup), name="all-done")
        await sup.wait()
        waiter.cancel()
    finally:
        # Not wait_for: it would wait for the cancelled close to end, and a close stuck on a peer that is
        # gone (a publish attempt's own timeout) may not end soon; the process exits anyway.
        closing = asyncio.ensure_future(sup.stack.aclose())
        done, _ = await asyncio.wait({closing}, timeout=max(0.5, sup.left() - 1.0))
        if not done:
            log.warning("closing resources took longer than the deadline; exiting anyway")
            closing.cancel()
        elif closing.exception() is not None:
            raise closing.exception()  # type: ignore[misc]
        if retry is not None:
            retry.stopping = before
    sup.raise_if_failed()


async def _all_done(sup: Supervisor) -> None:
    """If every spawned task finished on its own, the service is done."""
    while True:
        tasks = [t for t in sup._tasks.values() if not t.done()]
        if not tasks:
            sup.stop()
            return
        await asyncio.wait(tasks, return_when=asyncio.ALL_COMPLETED)
