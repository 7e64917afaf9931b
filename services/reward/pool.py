"""The scoring pool: reward functions run on a request's items in the pool processes, each item
within its own timeout, and every item gets a result (`ok`, `timeout` or `error`, never a silent 0).

A request's items go to the processes in batches (one message each way per batch): all in one batch
when the function is cheap (the pool measures each function's seconds per item), else split evenly
over the processes. When an item times out (its process is killed with everything it started) or
crashes its process, it alone gets that status; the other unanswered items of its batch are scored
again, one by one, in other processes. The items behind a slow one in its batch are taken back and
go one by one to other processes (extras included: see `procpool`).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from schemas.messages import RewardResult
from services.reward.procpool import PoolClosed, ProcessPool
from services.reward.procs import ItemTimeout, PoolProcess, ProcessDied
from services.reward.worker import MAX_BATCH, Outcome

SPLIT_S = 0.005
"""A request whose items are expected to take longer than this in all is split over the processes;
a cheaper one goes to one process in one batch (a second batch would cost more than it saves)."""
CHECK_TIMEOUT_S = 60.0
"""How long resolving a function (importing its module) in a pool process may take."""
COST_WEIGHT = 0.2
"""Weight of the latest batch in a function's running mean of seconds per item."""


class ScoringPool(ProcessPool):
    def __init__(self, processes: int, **kwargs: Any) -> None:
        super().__init__(processes, **kwargs)
        self._item_s: dict[str, float] = {}
        """Per function: running mean of seconds per item, measured in the pool processes."""

    async def check(self, ref: str) -> str:
        """'' if `ref` imports and is callable in a pool process, else the reason."""
        try:
            return str(await self._run("check", (ref,), CHECK_TIMEOUT_S))
        except Exception as exc:
            return f"could not load {ref} in a pool process: {self._explain(exc, CHECK_TIMEOUT_S)}"

    async def score(self, ref: str, kwargs: dict[str, Any], timeout_s: float) -> RewardResult:
        """One item (see `score_many`)."""
        return (await self.score_many(ref, [kwargs], timeout_s))[0]

    async def score_many(self, ref: str, items: list[dict[str, Any]], timeout_s: float) -> list[RewardResult]:
        """One result per item, in order, each within its own `timeout_s`."""
        out: list[RewardResult | None] = [None] * len(items)
        parts = self._split(ref, len(items))
        if len(parts) == 1:  # the usual case for a cheap function: no gather (a future and a task less)
            await self._score_batch(ref, items, parts[0], timeout_s, out)
        else:
            await asyncio.gather(*(self._score_batch(ref, items, part, timeout_s, out) for part in parts))
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
            if again or redo:
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
        if ref not in proc.resolved:
            # the function's module is imported now, not on the clock of the batch's first item
            problem = await self._resolve(proc, ref)
            if problem:
                for i in part:
                    out[i] = RewardResult(status="error", message=f"{ref} could not be loaded in a pool process: {problem}")
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

    async def _resolve(self, proc: PoolProcess, ref: str) -> str:
        """Have `proc` resolve `ref`: '' when done (`proc` still held), else why not (`proc` released)."""
        try:
            problem = str(await proc.call("check", (ref,), CHECK_TIMEOUT_S))
        except BaseException as exc:  # it may be stuck or gone mid-import: never reused
            self._discard(proc, exc)
            if not isinstance(exc, Exception):
                raise
            return self._explain(exc, CHECK_TIMEOUT_S)
        if problem:
            self._done(proc, 0)
            return problem
        proc.resolved.add(ref)
        return ""

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
