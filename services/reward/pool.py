"""The scoring pool: pebble's ProcessPool, one task per item with a per-item timeout.

pebble kills a task's process when its timeout expires and replaces any process that dies (os._exit,
a segfault, the OOM killer), failing only that task; we map those to `timeout` / `error` results.
If the pool as a whole breaks (pebble gives up when a process dies outside any task), the next call
builds a new one. Processes start with "forkserver" (or "spawn"), never fork: forking a process that
runs an asyncio loop and pebble's threads can copy held locks into the child.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import CancelledError as FutureCancelled
from typing import Any

from pebble import ProcessExpired, ProcessPool

from schemas.messages import RewardResult
from services.common.logging import get_logger
from services.reward import worker

log = get_logger("reward.pool")

FORKSERVER_PRELOAD = ("services.reward.worker", "services.reward.builtin")


class ScoringPool:
    def __init__(
        self, processes: int, *, start_method: str = "forkserver", preload: list[str] | None = None, max_tasks: int = 0
    ) -> None:
        self.processes = processes
        self.start_method = start_method
        self.preload = list(preload or [])
        self.max_tasks = max_tasks
        self.restarts = 0
        """Processes killed (timeout) or lost (crash) and replaced since start."""
        self.rebuilds = 0
        """Times the whole pool was rebuilt after pebble declared it broken."""
        self._pool: ProcessPool | None = None

    def _ensure(self) -> ProcessPool:
        if self._pool is not None and self._pool.active:
            return self._pool
        if self._pool is not None:
            log.warning("process pool broken; building a new one")
            self.rebuilds += 1
            self._pool.stop()
        ctx = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            # The fork server imports these once; every (re)started process is forked from it with
            # them loaded, so replacing a killed process costs milliseconds, not an import. Only our
            # own modules: the fork server survives nothing but ImportError in a preload, so user
            # modules are imported by the initializer instead, which survives anything.
            ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        self._pool = ProcessPool(
            max_workers=self.processes,
            max_tasks=self.max_tasks,
            initializer=worker.initialize,
            initargs=(self.preload,),
            context=ctx,
        )
        return self._pool

    async def start(self) -> None:
        """Start every process and wait until each has run a task, so the first request is fast."""
        await asyncio.gather(*(self._run(worker.ping) for _ in range(2 * self.processes)))

    async def check(self, ref: str) -> str:
        """'' if `ref` imports and is callable in a pool process, else the reason."""
        try:
            return await self._run(worker.check, ref, timeout_s=60.0)
        except Exception as exc:
            return f"could not load {ref} in a pool process: {self._explain(exc, 60.0)}"

    async def score(self, ref: str, kwargs: dict[str, Any], timeout_s: float) -> RewardResult:
        try:
            status, value = await self._run(worker.score, ref, kwargs, timeout_s=timeout_s)
        except TimeoutError:
            self.restarts += 1
            return RewardResult(status="timeout", message=f"{ref} ran past the {timeout_s:g} s per-item timeout; its process was killed")
        except Exception as exc:
            return RewardResult(status="error", message=self._explain(exc, timeout_s))
        if status == "ok":
            return RewardResult(status="ok", value=float(value))
        return RewardResult(status="error", message=str(value))

    def _explain(self, exc: BaseException, timeout_s: float) -> str:
        if isinstance(exc, ProcessExpired):
            self.restarts += 1
            how = f"signal {-exc.exitcode}" if exc.exitcode is not None and exc.exitcode < 0 else f"exit code {exc.exitcode}"
            return f"the scoring process died ({how}) while running the reward function; it was replaced"
        if isinstance(exc, TimeoutError):
            self.restarts += 1
            return f"ran past {timeout_s:g} s; its process was killed"
        if isinstance(exc, FutureCancelled | asyncio.CancelledError):
            return "cancelled (the reward service is shutting down)"
        return f"the scoring pool failed: {type(exc).__name__}: {exc}"

    async def _run(self, fn: Any, *args: Any, timeout_s: float | None = None) -> Any:
        future = self._ensure().schedule(fn, args=args, timeout=timeout_s)  # pebble kills the process past it
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # pebble kills the process running it
            raise

    async def close(self) -> None:
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        pool.stop()
        await asyncio.to_thread(pool.join, 5.0)
