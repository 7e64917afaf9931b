"""The scoring pool: `processes` pool processes, one item at a time each, with a per-item timeout.

An item that runs past its timeout has its process killed with everything it started (process group
and descendants); a process that dies (os._exit, a segfault, the OOM killer) fails only its item; in
both cases a new process takes its place. A slow item does not hold the queue: an item that has run
longer than `slow_item_s` no longer counts against the pool, and a waiting item gets an extra process
(at most `max_extra_processes`, stopped again once idle and the slow items are gone). Processes start from a
fork server ("forkserver", or "spawn"), never fork: forking a process that runs an asyncio loop and
threads can copy held locks into the child.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections import deque
from functools import partial
from typing import Any

from schemas.messages import RewardResult
from services.common.logging import get_logger
from services.reward.procs import PoolProcess, ProcessDied

log = get_logger("reward.pool")

FORKSERVER_PRELOAD = ("services.reward.worker", "services.reward.builtin")
START_TIMEOUT_S = 120.0
"""How long a new process may take to import the allowed modules before it counts as failed."""


class PoolClosed(RuntimeError):
    """The pool was closed (the service is stopping) while the item waited for a process."""


class ScoringPool:
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

    async def check(self, ref: str) -> str:
        """'' if `ref` imports and is callable in a pool process, else the reason."""
        try:
            return str(await self._run("check", (ref,), 60.0))
        except Exception as exc:
            return f"could not load {ref} in a pool process: {self._explain(exc, 60.0)}"

    async def score(self, ref: str, kwargs: dict[str, Any], timeout_s: float) -> RewardResult:
        try:
            status, value = await self._run("score", (ref, kwargs), timeout_s)
        except TimeoutError:
            return RewardResult(status="timeout", message=f"{ref} ran past the {timeout_s:g} s per-item timeout; its process was killed")
        except Exception as exc:
            return RewardResult(status="error", message=self._explain(exc, timeout_s))
        if status == "ok":
            return RewardResult(status="ok", value=float(value))
        return RewardResult(status="error", message=str(value))

    @staticmethod
    def _explain(exc: BaseException, timeout_s: float) -> str:
        if isinstance(exc, ProcessDied):
            return f"{exc} while running the reward function; it was replaced"
        if isinstance(exc, TimeoutError):
            return f"ran past {timeout_s:g} s; its process was killed"
        if isinstance(exc, PoolClosed):
            return "cancelled (the reward service is shutting down)"
        return f"the scoring pool failed: {type(exc).__name__}: {exc}"

    async def _run(self, op: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        proc = await self._acquire()
        try:
            reply = await proc.call(op, args, timeout_s)
        except BaseException as exc:  # timeout, death, cancellation: it may be mid-item; never reused
            self._discard(proc, exc)
            raise
        proc.tasks += 1
        if self.max_tasks and proc.tasks >= self.max_tasks:
            self._discard(proc, None)  # recycled: guards against leaky reward code
        else:
            self._release(proc)
        return reply

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
            return await self._launch()
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
        if len(self._procs) > self.processes:
            self.extra_started += 1
        if waiter.done():  # the item was cancelled meanwhile
            self._release(proc)
        else:
            waiter.set_result(proc)

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
        proc = PoolProcess(self._ctx, self.preload)
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
