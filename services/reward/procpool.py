"""The pool's processes: `processes` of them warm, each running one batch at a time; which one runs
the next batch, extra processes for batches waiting behind slow items, and replacing a process that
was killed (timeout) or lost (crash, or killed from outside while idle). An item that has run longer
than `slow_item_s` no longer counts against the pool: a batch waiting for a process gets an extra one
(at most `max_extra_processes`, stopped again once idle and the slow items are gone). Processes
start from a fork server ("forkserver", or "spawn"), never fork: forking a process that runs an
asyncio loop and threads can copy held locks into the child. What is scored, and how a request
becomes batches, is `services.reward.pool`.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections import deque
from functools import partial
from typing import Any

from services.common.logging import get_logger
from services.reward.procs import PoolProcess, ProcessDied

log = get_logger("reward.pool")

FORKSERVER_PRELOAD = ("services.reward.worker", "services.reward.builtin")
START_TIMEOUT_S = 120.0
"""How long a new process may take to import the allowed modules before it counts as failed."""


class PoolClosed(RuntimeError):
    """The pool was closed (the service is stopping) while the item waited for a process."""


class ProcessPool:
    """The processes: which one runs the next batch, extras behind slow items, replacing the lost."""

    def __init__(
        self,
        processes: int,
        *,
        start_method: str = "forkserver",
        preload: list[str] | None = None,
        max_tasks: int = 0,
        max_extra: int = 4,
        slow_item_s: float = 1.0,
    ) -> None:
        self.processes = processes
        self.start_method = start_method
        self.preload = list(preload or [])
        self.max_tasks = max_tasks
        self.max_extra = max_extra
        self.slow_item_s = slow_item_s
        self.restarts = 0
        """Processes killed (timeout) or lost (crash) and replaced since start."""
        self.extra_started = 0
        """Processes started beyond `processes` because the items ahead were slow."""
        self._procs: set[PoolProcess] = set()
        self._idle: list[PoolProcess] = []
        self._waiters: deque[asyncio.Future[PoolProcess]] = deque()
        self._starting = 0
        self._timer: asyncio.TimerHandle | None = None
        self._spawning: set[asyncio.Task[PoolProcess]] = set()
        self._closed = False
        ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # The fork server imports these once; every process is forked from it with them loaded, so
            # replacing a killed process costs milliseconds, not an import. Only our own modules: the
            # fork server survives nothing but ImportError in a preload, so user modules are imported
            # by each process after it starts, which survives anything.
            ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        self._ctx = ctx

    @property
    def size(self) -> int:
        """Processes running now (extras included)."""
        return len(self._procs)

    @property
    def busy(self) -> int:
        """Processes running an item now."""
        return sum(1 for p in self._procs if p.busy_since is not None)

    async def start(self) -> None:
        """Start every process and have each answer once, so the first request is fast."""
        procs = await asyncio.gather(*(self._launch() for _ in range(self.processes)))
        for proc in procs:
            await proc.call("ping", (), START_TIMEOUT_S)
            self._release(proc)

    async def _run(self, op: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        proc = await self._acquire()
        try:
            reply = await proc.call(op, args, timeout_s)
        except BaseException as exc:  # timeout, death, cancellation: it may be mid-item; never reused
            self._discard(proc, exc)
            raise
        self._done(proc, 1)
        return reply

    def _done(self, proc: PoolProcess, items: int) -> None:
        """`proc` answered `items` items: back to the pool, or recycled past `max_tasks`."""
        proc.tasks += items
        if self.max_tasks and proc.tasks >= self.max_tasks:
            self._discard(proc, None)  # recycled: guards against leaky reward code
        else:
            self._release(proc)

    # -- which process runs the next item --------------------------------------------------------

    def _capacity(self) -> int:
        slow = sum(1 for p in self._procs if self._is_slow(p))
        return self.processes + min(self.max_extra, slow)

    def _is_slow(self, proc: PoolProcess) -> bool:
        return proc.busy_since is not None and time.monotonic() - proc.busy_since >= self.slow_item_s

    def _room(self) -> bool:
        return not self._closed and len(self._procs) + self._starting < self._capacity()

    async def _acquire(self) -> PoolProcess:
        if self._closed:
            raise PoolClosed("the scoring pool is closed")
        if self._idle:
            return self._idle.pop()
        if self._room() and not self._waiters:
            proc = await self._launch()
            self._count_extra()
            return proc
        waiter: asyncio.Future[PoolProcess] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._kick()
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result())  # handed over just as we were cancelled: pass it on
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            raise

    def _release(self, proc: PoolProcess) -> None:
        """`proc` is idle: to the first waiter, else back to the pool."""
        if proc.dead:  # ended between its reply and now: replaced, never handed an item
            self._discard(proc, ProcessDied(proc.proc.exitcode))
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(proc)
                return
        self._idle.append(proc)
        self._trim()

    def _trim(self) -> None:
        """Stop idle processes the pool has beyond its capacity: extras started for items behind slow
        ones stay while those are still slow (the next item reuses them), and go once they are not."""
        while self._idle and (self._closed or len(self._procs) > self._capacity()):
            proc = self._idle.pop(0)
            self._procs.discard(proc)
            proc.kill()

    def _discard(self, proc: PoolProcess, why: BaseException | None) -> None:
        self._procs.discard(proc)
        others = proc.kill()
        if isinstance(why, TimeoutError | ProcessDied):
            self.restarts += 1
            log.warning("scoring process replaced", pid=proc.pid, why=str(why) or "timeout", killed_descendants=others)
        self._kick()  # its place is free: a waiting item may start a process now
        self._trim()
        self._replenish()

    def _lost(self, proc: PoolProcess) -> None:
        """An idle process ended (killed from outside): replaced now, so no item is sent to it."""
        if proc in self._idle:
            self._idle.remove(proc)
            self._discard(proc, ProcessDied(proc.proc.exitcode))

    def _kick(self) -> None:
        """Start processes for waiting items while there is room; while items still wait, look again
        when the oldest busy item turns slow (or soon, if none is about to)."""
        while self._waiters and self._room():
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._launch().add_done_callback(partial(self._hand_over, waiter))
        if self._timer is not None or not self._waiters or self._closed:
            return
        now = time.monotonic()
        turning = [p.busy_since + self.slow_item_s - now for p in self._procs if p.busy_since is not None and not self._is_slow(p)]
        delay = min(turning) if turning else self.slow_item_s / 4
        self._timer = asyncio.get_running_loop().call_later(max(delay, 0.0) + 0.01, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._kick()

    def _hand_over(self, waiter: asyncio.Future[PoolProcess], task: asyncio.Task[PoolProcess]) -> None:
        """A process started for `waiter` is ready (or failed to start)."""
        if task.cancelled() or task.exception() is not None:
            if not waiter.done():
                waiter.set_exception(task.exception() or PoolClosed("the scoring pool is closed"))
            return
        proc = task.result()
        self._count_extra()
        if waiter.done():  # the item was cancelled meanwhile
            self._release(proc)
        else:
            waiter.set_result(proc)

    def _count_extra(self) -> None:
        """A process just started for an item: beyond `processes`, it is an extra."""
        if len(self._procs) > self.processes:
            self.extra_started += 1

    def _replenish(self) -> None:
        """Keep `processes` warm: a killed or lost process is replaced now, not by the next item."""
        for _ in range(self.processes - len(self._procs) - self._starting):
            self._launch().add_done_callback(self._to_pool)

    def _to_pool(self, task: asyncio.Task[PoolProcess]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            log.warning("could not start a scoring process; the next item tries again", error=repr(task.exception()))
            return
        self._release(task.result())

    def _launch(self) -> asyncio.Task[PoolProcess]:
        """Start a process in the background; counted in `_starting` at once, so `_room` sees it."""
        self._starting += 1
        task = asyncio.get_running_loop().create_task(self._spawn())
        self._spawning.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._spawned)
        return task

    def _spawned(self, task: asyncio.Task[PoolProcess]) -> None:
        self._starting -= 1
        self._spawning.discard(task)

    async def _spawn(self) -> PoolProcess:
        proc = PoolProcess(self._ctx, self.preload, on_lost=self._lost)
        try:
            await proc.start(START_TIMEOUT_S)
        except BaseException:
            proc.kill()
            raise
        if self._closed:
            proc.kill()
            raise PoolClosed("the scoring pool is closed")
        self._procs.add(proc)
        return proc

    async def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(PoolClosed("the scoring pool is closed"))
        for task in list(self._spawning):
            task.cancel()
        for proc in list(self._procs):
            with contextlib.suppress(Exception):
                proc.kill()
        self._procs.clear()
        self._idle.clear()
