"""The decode loop: admits waiting requests, steps the batch, finishes sequences; pause and abort.

One asyncio task owns the schedule; every backend call (prefill, decode, remove, weight load) runs in
one dedicated thread, so the event loop keeps answering HTTP during a step and a weight update always
lands between two steps. A request can join or leave the batch at any step.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.common.logging import get_logger
from services.inference.requests import Joining, SamplingParams

log = get_logger("inference.scheduler")
T = TypeVar("T")
BEFORE_PREFILL = "Abort before prefill"


@dataclass(eq=False)
class Seq:
    sid: int
    rid: str
    prompt: list[int]
    params: SamplingParams
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    """Per output position, its most likely (logprob, token id) when `params.top_logprobs_num` asks;
    None where the backend reports none (the simulator)."""
    versions: list[str] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    prefilled: bool = False
    finished_at: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    """Set after every step that touched this sequence (streaming waits on it)."""


class Scheduler:
    def __init__(self, backend: Any, max_batch_size: int) -> None:
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.waiting: deque[Seq] = deque()
        self.running: dict[int, Seq] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._abort: set[str] = set()  # rids to abort
        self._abort_all = False
        self._abort_done: list[asyncio.Future[None]] = []
        self._leaving: set[int] = set()  # sids whose rows leave the batch at the next step
        self._holding = False  # paused in_place / retract: running requests kept but not stepped
        self.tokens_generated = 0
        self.requests_finished = 0
        self.model_steps = 0
        """Batch steps run (`tokens_generated / model_steps`: the mean rows of a step)."""

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def in_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---- requests ------------------------------------------------------------------------------
    async def submit(self, prompt: list[int], params: SamplingParams, rid: str | None) -> Seq:
        """Queue a request (blocking first while generation is paused)."""
        await self._resumed.wait()
        sid = next(self._ids)
        seq = Seq(sid=sid, rid=rid or f"req-{sid}", prompt=prompt, params=params)
        if params.max_new_tokens == 0:
            self._finish(seq, {"type": "length", "length": 0})
            return seq
        self.waiting.append(seq)
        self._wake.set()
        return seq

    def abort_soon(self, rid: str) -> None:
        """Mark one request for abort at the next step, without waiting (for a handler being cancelled)."""
        self._abort.add(rid)
        self._wake.set()

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request by rid (None: all); returns once the loop has done it."""
        if rid is None:
            self._abort_all = True
        else:
            self._abort.add(rid)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._abort_done.append(fut)
        self._wake.set()
        await fut

    async def pause(self, mode: str = "abort") -> None:
        """New requests block until `resume`. `abort`: in-flight requests end with `abort` and their
        partial output. `in_place` / `retract`: they stay in the batch, not stepped, and go on after
        `resume` (a weight update in between makes their later tokens carry the new version)."""
        self._resumed.clear()
        self._holding = mode != "abort"
        if not self._holding:
            await self.abort(None)

    async def wait_resumed(self) -> None:
        await self._resumed.wait()

    def resume(self) -> None:
        self._holding = False
        self._resumed.set()
        self._wake.set()

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self, stopping: asyncio.Event) -> None:
        try:
            while not (stopping.is_set() and not self.waiting and not self.running):
                idle = self._holding or (not self.waiting and not self.running)
                if idle and not (self._abort_done or self._abort or self._abort_all):
                    waiter = asyncio.ensure_future(self._wake.wait())
                    stop = asyncio.ensure_future(stopping.wait())
                    await asyncio.wait([waiter, stop], return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    stop.cancel()
                self._wake.clear()
                await self._do_aborts()
                if not self._holding:
                    await self._step()
        finally:
            self.executor.shutdown(wait=False, cancel_futures=True)

    async def _do_aborts(self) -> None:
        """Between steps: finish aborted sequences now; their rows leave the batch at the next step."""
        if not (self._abort_done or self._abort or self._abort_all):
            return
        everything, rids = self._abort_all, self._abort
        self._abort_all, self._abort = False, set()
        waiters, self._abort_done = self._abort_done, []
        hit = lambda s: everything or s.rid in rids  # noqa: E731
        for seq in [s for s in self.waiting if hit(s)]:
            self.waiting.remove(seq)
            self._finish(seq, {"type": "abort", "message": BEFORE_PREFILL, "status_code": 200, "err_type": None})
        for sid in [sid for sid, s in self.running.items() if hit(s)]:
            self._finish(self.running.pop(sid), {"type": "abort", "message": "Aborted by request", "status_code": 200, "err_type": None})
            self._leaving.add(sid)
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def _step(self) -> None:
        room = self.max_batch_size - len(self.running)
        joining: list[Seq] = []
        while self.waiting and room > 0:
            joining.append(self.waiting.popleft())
            room -= 1
        if not joining and not self.running:
            if self._leaving:  # free the rows of aborted sequences even when nothing else runs
                leaving, self._leaving = self._leaving, set()
                await self.in_model_thread(self.backend.remove, leaving)
            return
        for seq in joining:
            seq.prefilled = True
            self.running[seq.sid] = seq
        leaving, self._leaving = self._leaving, set()
        out, version = await self.in_model_thread(
            self.backend.step, leaving, [Joining(s.sid, s.prompt, s.params) for s in joining]
        )
        self.model_steps += 1
        self._apply(out, version)

    def _apply(self, out: list[tuple[Any, ...]], version: str) -> None:
        # (sid, token, logprob) and, from a backend that computes them, the position's top log-probs
        for sid, tok, lp, *top in out:
            seq = self.running.get(sid)
            if seq is None:  # aborted while the step ran; its row leaves next step
                continue
            seq.output_ids.append(tok)
            seq.logprobs.append(lp)
            seq.top_logprobs.append(top[0] if top else None)
            seq.versions.append(version)
            seq.progress.set()
            finish = self._stop_check(seq, tok)
            if finish is not None:
                self._finish(seq, finish)
                del self.running[sid]
                self._leaving.add(sid)
        self.tokens_generated += len(out)

    def _stop_check(self, seq: Seq, tok: int) -> dict[str, Any] | None:
        """SGLang's finish rules (`Req.update_finish_state`): with `ignore_eos` no token ends the output,
        neither EOS nor `stop_token_ids`; a completed grammar ends it after the length check."""
        p, n = seq.params, len(seq.output_ids)
        failed = getattr(self.backend, "grammar_failed", None)
        if failed and seq.sid in failed:
            return {"type": "abort", "message": failed.pop(seq.sid), "status_code": 400, "err_type": "BadRequestError"}
        if n >= p.min_new_tokens:
            if not p.ignore_eos and (tok in self.backend.eos_ids or tok in p.stop_token_ids):
                return {"type": "stop", "matched": tok}
            if p.stop:
                longest = max(len(s) for s in p.stop)
                tail = self.backend.decode_text(seq.output_ids[-(longest + 4):], False) or ""
                for s in p.stop:
                    if tail.endswith(s):
                        return {"type": "stop", "matched": s}
        if n >= p.max_new_tokens:
            return {"type": "length", "length": n}
        done = getattr(self.backend, "grammar_done", None)
        if done and seq.sid in done:
            done.discard(seq.sid)
            return {"type": "stop", "matched": tok}
        return None

    def _finish(self, seq: Seq, finish: dict[str, Any]) -> None:
        seq.finish = finish
        seq.finished_at = time.monotonic()
        self.requests_finished += 1
        seq.progress.set()
        seq.done.set()
