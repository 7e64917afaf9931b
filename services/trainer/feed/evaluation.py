"""Eval rounds: the trainer issues the eval set every `feeder.eval_every` steps; this reads the answers.

A round is the eval prompts issued after one step (prompt ids `eval<step>-<i>`). Rollout workers answer
each with a group or a rejection marker on `jetrl.<run>.trajectories.eval`. When every prompt of a
round is answered, or `feeder.eval_timeout_s` passes, one `MetricsEvent` goes out on
`jetrl.<run>.metrics.eval` with `step` = the round's step. A core subscription is enough: eval metrics
need not survive a trainer restart (rounds issued before a restart are never reported).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from nats.aio.client import Client as NATS

from schemas import metric_names as names
from schemas.headers import is_rejection
from schemas.messages import MessageError, RejectionMarker, decode
from schemas.subjects import HDR_PROMPT_ID, Subjects
from schemas.trajectory import TrajectoryError, decode_group
from services.common.bus import unsubscribe_quietly
from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher

log = get_logger("trainer.eval")


@dataclass
class Round:
    step: int
    expected: set[str]
    rewards: list[np.ndarray] = field(default_factory=list)
    answered: set[str] = field(default_factory=set)
    groups: int = 0
    rejected: int = 0
    malformed: int = 0

    @property
    def complete(self) -> bool:
        return self.answered >= self.expected

    def values(self) -> dict[str, float]:
        values = {"eval_groups": float(self.groups), "eval_rejected": float(self.rejected),
                  "eval_malformed": float(self.malformed), "eval_expected": float(len(self.expected)),
                  "eval_complete": float(self.complete)}
        if self.rewards:  # no groups: no reward to report (a 0 would read as a wrong answer)
            r = np.concatenate(self.rewards)
            values.update({names.EVAL_REWARD_MEAN: float(r.mean()), names.EVAL_ACCURACY: float((r >= 1.0).mean()),
                           "eval_samples": float(r.size)})
        return values


class EvalRounds:
    """Collect eval answers per round and report each round once."""

    def __init__(self, nc: NATS, run: str, timeout_s: float) -> None:
        self.nc = nc
        self.subjects = Subjects(run)
        self.timeout_s = timeout_s
        self.metrics = MetricsPublisher(nc, run, "eval")
        self.rounds: dict[int, Round] = {}
        self._round_of: dict[str, int] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._emitting: set[asyncio.Task[None]] = set()
        self._sub: Any = None
        self._idle = asyncio.Event()
        """Set while no round is open."""
        self._idle.set()

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subjects.trajectories_eval, cb=self._on_msg)

    def expect(self, step: int, prompt_ids: Iterable[str]) -> None:
        """Register a round before its prompts are published, so no answer can arrive first."""
        ids = set(prompt_ids)
        if not ids:
            return
        old = self._timers.pop(step, None)
        if old is not None:  # the same step trained again after a resume: the new round replaces it
            old.cancel()
        self.rounds[step] = Round(step, ids)
        self._idle.clear()
        self._round_of.update(dict.fromkeys(ids, step))
        self._timers[step] = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, step)

    async def _on_msg(self, msg: Any) -> None:
        self.on_message(msg.data, msg.headers)

    def on_message(self, data: bytes, headers: dict[str, str] | None) -> None:
        pid, rewards, outcome = self._read(data, headers)
        step = self._round_of.get(pid) if pid is not None else None
        rnd = self.rounds.get(step) if step is not None else None
        if pid is None or step is None or rnd is None:
            if outcome == "malformed":
                self.metrics.count("eval_malformed_messages")
            log.info("eval answer for no open round; skipped", prompt_id=pid, outcome=outcome)
            return
        if pid in rnd.answered:
            return  # a redelivered episode answered twice
        rnd.answered.add(pid)
        if outcome == "group":
            rnd.groups += 1
            rnd.rewards.append(rewards)
        elif outcome == "rejected":
            rnd.rejected += 1
        else:
            rnd.malformed += 1
            self.metrics.count("eval_malformed_messages")
        if rnd.complete:
            self._finish(step)

    @staticmethod
    def _read(data: bytes, headers: dict[str, str] | None) -> tuple[str | None, np.ndarray, str]:
        """(prompt id, rewards, group | rejected | malformed); a malformed message keeps its header id."""
        header_pid = (headers or {}).get(HDR_PROMPT_ID)
        empty = np.zeros(0, dtype=np.float32)
        try:
            if is_rejection(headers):
                return decode(RejectionMarker, data).prompt_id, empty, "rejected"
            decoded = decode_group(data)
            return decoded.meta.prompt_id, np.asarray(decoded.tensors["rewards"], dtype=np.float32).ravel(), "group"
        except (MessageError, TrajectoryError, ValueError, KeyError) as exc:
            log.warning("malformed eval message skipped", prompt_id=header_pid, error=str(exc))
            return header_pid, empty, "malformed"

    def _expire(self, step: int) -> None:
        rnd = self.rounds.get(step)
        if rnd is not None:
            log.warning("eval round timed out", step=step, answered=len(rnd.answered), expected=len(rnd.expected))
            self._finish(step)

    def _finish(self, step: int) -> None:
        rnd = self.rounds.pop(step)
        for pid in rnd.expected:
            self._round_of.pop(pid, None)
        timer = self._timers.pop(step, None)
        if timer is not None:
            timer.cancel()
        values = rnd.values()
        log.info("eval round", step=step, **{k: round(v, 4) for k, v in values.items()})
        task = asyncio.get_running_loop().create_task(self.metrics.emit(values, step=step, version=step), name=f"eval-emit-{step}")
        self._emitting.add(task)
        task.add_done_callback(self._emitting.discard)
        if not self.rounds:
            self._idle.set()

    async def settled(self, stopping: asyncio.Event) -> None:
        """Until every open round is reported (answered in full, or at its timeout) or `stopping` is set:
        a run that ends at an eval step reports that round instead of dropping it."""
        if self._idle.is_set():
            return
        log.info("waiting for the open eval rounds to be answered", steps=sorted(self.rounds), timeout_s=self.timeout_s)
        idle, stop = asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({idle, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            stop.cancel()

    async def close(self) -> None:
        """Stop listening; rounds still open are dropped (logged), pending reports are sent."""
        for timer in self._timers.values():
            timer.cancel()
        if self.rounds:
            log.info("eval rounds left open at shutdown", steps=sorted(self.rounds))
        self._timers.clear()
        self.rounds.clear()
        sub, self._sub = self._sub, None
        await unsubscribe_quietly(sub, "eval")
        if self._emitting:
            await asyncio.gather(*self._emitting, return_exceptions=True)
