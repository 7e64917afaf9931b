"""The scoring pool: `processes` pool processes, one batch of items at a time each, with a per-item
timeout.

A request's items go to the processes in batches (one message each way per batch): all in one batch
when the function is cheap (the pool measures each function's seconds per item), else split evenly
over the processes. An item that runs past its timeout has its process killed with everything it started (process group
and descendants); a process that dies (os._exit, a segfault, the OOM killer) fails only its item; in
both cases a new process takes its place. A slow item does not hold the queue: an item that has run
longer than `slow_item_s` no longer counts against the pool, and a waiting item gets an extra process
(at most `max_extra_processes`, stopped again once idle and the slow items are gone); the items behind
a slow one in its batch are taken back and go one by one to other processes. When an item times out
or crashes its process, it alone gets that status; the other unanswered items of its batch are scored
again, one by one, in other processes. Processes start from a
fork server ("forkserver", or "spawn"), never fork: forking a process that runs an asyncio loop and
threads can copy held locks into the child.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import time
from collections import deque
from functools import partial
from typing import Any

from schemas.messages import RewardResult
from services.common.logging import get_logger
from services.reward.procs import ItemTimeout, PoolProcess, ProcessDied
from services.reward.worker import MAX_BATCH, Outcome

log = get_logger("reward.pool")

FORKSERVER_PRELOAD = ("services.reward.worker", "services.reward.builtin")
START_TIMEOUT_S = 120.0
"""How long a new process may take to import the allowed modules before it counts as failed."""
SPLIT_S = 0.005
"""A request whose items are expected to take longer than this in all is split over the processes;
a cheaper one goes to one process in one batch (a second batch would cost more than it saves)."""
COST_WEIGHT = 0.2
"""Weight of the latest batch in a function's running mean of seconds per item."""


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
        self._item_s: dict[str, float] = {}
        """Per function: running mean of seconds per item, measured in the pool processes."""
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
        """One item (see `score_many`)."""
        return (await self.score_many(ref, [kwargs], timeout_s))[0]

    async def score_many(self, ref: str, items: list[dict[str, Any]], timeout_s: float) -> list[RewardResult]:
        """One result per item, in order, each within its own `timeout_s`."""
        out: list[RewardResult | None] = [None] * len(items)
        await asyncio.gather(*(self._score_batch(ref, items, part, timeout_s, out) for part in self._split(ref, len(items))))
        return [r or RewardResult(status="error", message="not scored (a bug of the scoring pool)") for r in out]

    def _split(self, ref: str, n: int) -> list[list[int]]:
        """The request's item positions in batches: one when the function is known to be cheap, else
        one per process (a function not measured yet counts as expensive)."""
        item_s = self._item_s.get(ref)
        parts = self.processes if item_s is None else math.ceil(n * item_s / SPLIT_S)
        parts = max(1, min(parts, self.processes, n), math.ceil(n / MAX_BATCH))
        size = math.ceil(n / parts)
        return [list(range(i, min(n, i + size))) for i in range(0, n, size)]

    def _measured(self, ref: str, item_s: float) -> None:
        before = self._item_s.get(ref)
        self._item_s[ref] = item_s if before is None else before + COST_WEIGHT * (item_s - before)

    async def _score_batch(
        self, ref: str, items: list[dict[str, Any]], part: list[int], timeout_s: float, out: list[RewardResult | None]
    ) -> None:
        """Score `items[i] for i in part` in one process and put the results in `out`. What it could not
        answer (taken back behind a slow item, or left when a failing item took its process down) is
        scored one item per batch, so a second bad item cannot hold up the rest again."""
        again: list[asyncio.Task[None]] = []

        def take_back(first: int) -> None:
            for i in part[first:]:
                again.append(asyncio.get_running_loop().create_task(self._score_batch(ref, items, [i], timeout_s, out)))

        try:
            redo = await self._score_in_process(ref, items, part, timeout_s, out, take_back)
            await asyncio.gather(*again, *(self._score_batch(ref, items, [i], timeout_s, out) for i in redo))
        finally:
            for task in again:
                task.cancel()  # a no-op once done; ends them when this request is cancelled

    async def _score_in_process(
        self,
        ref: str,
        items: list[dict[str, Any]],
        part: list[int],
        timeout_s: float,
        out: list[RewardResult | None],
        take_back: Any,
    ) -> list[int]:
        """One batch in one process; returns the positions of `part` to score again."""
        try:
            proc = await self._acquire()
        except Exception as exc:
            for i in part:
                out[i] = RewardResult(status="error", message=self._explain(exc, timeout_s))
            return []
        batch = [items[i] for i in part]
        try:
            outcomes, seconds = await proc.call(
                "score", (ref, batch), timeout_s, items=len(part), slow_s=self.slow_item_s, on_slow=take_back
            )
        except (ItemTimeout, ProcessDied) as exc:
            mine = proc.limit  # the items from here on were taken back and are scored elsewhere
            self._discard(proc, exc)
            if exc.position < mine:
                out[part[exc.position]] = self._failed(ref, exc, timeout_s)
            if isinstance(exc, ItemTimeout):
                self._measured(ref, timeout_s)
            return [part[j] for j in range(min(mine, len(part))) if j != exc.position]
        except BaseException as exc:  # cancellation, a broken pipe: it may be mid-item; never reused
            self._discard(proc, exc)
            if isinstance(exc, Exception):
                for i in part:
                    out[i] = RewardResult(status="error", message=self._explain(exc, timeout_s))
                return []
            raise
        mine = proc.limit
        self._done(proc, len(outcomes))
        if outcomes:
            self._measured(ref, seconds / len(outcomes))
        for j, outcome in enumerate(outcomes[:mine]):
            out[part[j]] = self._result(outcome)
        return part[len(outcomes) : mine]

    @staticmethod
    def _result(outcome: Outcome) -> RewardResult:
        status, value = outcome
        if status == "ok":
            return RewardResult(status="ok", value=float(value))
        return RewardResult(status="error", message=str(value))

    def _failed(self, ref: str, exc: ItemTimeout | ProcessDied, timeout_s: float) -> RewardResult:
        if isinstance(exc, ItemTimeout):
            return RewardResult(status="timeout", message=f"{ref} ran past the {timeout_s:g} s per-item timeout; its process was killed")
        return RewardResult(status="error", message=self._explain(exc, timeout_s))

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
