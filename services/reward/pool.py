"""The scoring pool: `processes` pool processes, one item at a time each, with a per-item timeout.

An item that runs past its timeout has its process killed with everything it started (process group
and descendants); a process that dies (os._exit, a segfault, the OOM killer) fails only its item; in
both cases a new process takes its place. A slow item does not hold the queue: an item that has run
longer than `slow_item_s` no longer counts against the pool, and a waiting item gets an extra process
(at most `max_extra_processes`, stopped again once idle with nothing waiting). Processes start from a
fork server ("forkserver", or "spawn"), never fork: forking a process that runs an asyncio loop and
threads can copy held locks into the child.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections import deque
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

    async def start(self) -> None:
        """Start every process and have each answer once, so the first request is fast."""
        procs = await asyncio.gather(*(self._spawn() for _ in range(self.processes)))
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
            return await self._spawn()
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
        """`proc` is idle: to the first waiter, else back to the pool (an extra one is stopped)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(proc)
                return
        if len(self._procs) > self.processes or self._closed:
            self._procs.discard(proc)
            proc.kill()
        else:
            self._idle.append(proc)

    def _discard(self, proc: PoolProcess, why: BaseException | None) -> None:
        self._procs.discard(proc)
        others = proc.kill()
        if isinstance(why, TimeoutError | ProcessDied):
            self.restarts += 1
            log.warning("scoring process replaced", pid=proc.pid, why=str(why) or "timeout", killed_descendants=others)
        self._kick()  # its place is free: a waiting item may start a process now

    def _kick(self) -> None:
        """Start processes for waiting items while there is room; while items still wait, look again
        when the oldest busy item turns slow (or soon, if none is about to)."""
        while self._waiters and self._room():
            waiter = self._waiters.popleft()
            if not waiter.done():
                asyncio.get_running_loop().create_task(self._spawn_for(waiter))
        if self._timer is not None or not self._waiters or self._closed:
            return
        now = time.monotonic()
        turning = [p.busy_since + self.slow_item_s - now for p in self._procs if p.busy_since is not None and not self._is_slow(p)]
        delay = min(turning) if turning else self.slow_item_s / 4
        self._timer = asyncio.get_running_loop().call_later(max(delay, 0.0) + 0.01, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._kick()

    async def _spawn_for(self, waiter: asyncio.Future[PoolProcess]) -> None:
        try:
            proc = await self._spawn()
        except Exception as exc:
            if not waiter.done():
                waiter.set_exception(exc)
            return
        if len(self._procs) > self.processes:
            self.extra_started += 1
        if waiter.done():  # the item was cancelled meanwhile
            self._release(proc)
        else:
            waiter.set_result(proc)

    async def _spawn(self) -> PoolProcess:
        self._starting += 1
        try:
            proc = PoolProcess(self._ctx, self.preload)
            try:
                await proc.start(START_TIMEOUT_S)
            except BaseException:
                proc.kill()
                raise
            self._procs.add(proc)
            return proc
        finally:
            self._starting -= 1

    async def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(PoolClosed("the scoring pool is closed"))
        for proc in list(self._procs):
            with contextlib.suppress(Exception):
                proc.kill()
        self._procs.clear()
        self._idle.clear()
