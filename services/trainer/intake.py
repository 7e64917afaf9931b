"""What the trainer does with each trajectory message: decode, then accept it into the next step, or
count it as rejected (marker, stale) so the feeder re-issues, or as filtered (zero-variance: freed, not
re-issued), or skip a duplicate or a foreign one (a prompt of an earlier incarnation of the run), or
terminate a malformed one. Pure bookkeeping: the bus loop lives in `loop.py`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.headers import is_rejection
from schemas.messages import MessageError, RejectionMarker, decode
from schemas.subjects import HDR_PROMPT_ID
from schemas.trajectory import DecodedGroup, TrajectoryError, decode_group
from services.trainer.feeder import Feeder


@dataclass
class Group:
    prompt_id: str
    tensors: dict[str, np.ndarray]
    head_version: int
    seq: int


@dataclass
class Verdict:
    outcome: str
    """accepted | rejected | stale | filtered | duplicate | foreign | malformed"""
    prompt_id: str | None = None
    group: Group | None = None
    error: str = ""


@dataclass
class Intake:
    eta: int
    dynamic_filtering: bool = False
    feeder: Feeder | None = None
    trained: set[str] = field(default_factory=set)
    """Every prompt_id accepted for training (checkpointed): a redelivered or replayed one is skipped."""
    counts: Counter[str] = field(default_factory=Counter)

    def judge(self, data: bytes, headers: dict[str, str] | None, seq: int, version: int, *,
              decoded: DecodedGroup | Exception | None = None) -> Verdict:
        """`decoded`: `decode_group(data)` already done by the caller (replay decodes a pull's groups
        together), or the exception it raised; None: decoded here."""
        verdict = self._judge(data, headers, seq, version, decoded)
        self.counts[verdict.outcome] += 1
        pid = verdict.prompt_id
        if verdict.outcome == "accepted" and pid is not None:
            self.trained.add(pid)
            if self.feeder is not None:
                self.feeder.on_accepted(pid)
        elif verdict.outcome == "filtered" and pid is not None and self.feeder is not None:
            self.feeder.on_filtered(pid)
        elif verdict.outcome in ("rejected", "stale", "malformed") and pid is not None:
            # Each of these yields nothing trainable for the prompt: the feeder issues it again
            # (a stale group uncharged: old weights are not the row's fault).
            if self.feeder is not None:
                if verdict.outcome == "stale":
                    self.feeder.on_stale(pid)
                else:
                    self.feeder.on_rejected(pid, verdict.outcome)
        return verdict

    def _judge(self, data: bytes, headers: dict[str, str] | None, seq: int, version: int,
               decoded: DecodedGroup | Exception | None) -> Verdict:
        header_pid = (headers or {}).get(HDR_PROMPT_ID)
        if is_rejection(headers):
            try:
                marker = decode(RejectionMarker, data)
            except MessageError as exc:
                return Verdict("malformed", header_pid, error=str(exc))
            if not self._ours(marker.prompt_id):
                return Verdict("foreign", marker.prompt_id)
            if marker.prompt_id in self.trained:
                return Verdict("duplicate", marker.prompt_id)
            return Verdict("rejected", marker.prompt_id)
        try:
            if isinstance(decoded, Exception):
                raise decoded
            group = decode_group(data) if decoded is None else decoded
        except (TrajectoryError, ValueError, KeyError) as exc:
            return Verdict("malformed", header_pid, error=str(exc))
        pid = group.meta.prompt_id
        if not self._ours(pid):
            return Verdict("foreign", pid)
        if pid in self.trained:
            return Verdict("duplicate", pid)
        head = group.meta.head_version
        if version - head > self.eta:
            return Verdict("stale", pid)
        rewards = group.tensors["rewards"]
        if self.dynamic_filtering and rewards.size > 0 and np.all(rewards == rewards.flat[0]):
            return Verdict("filtered", pid)
        return Verdict("accepted", pid, Group(pid, group.tensors, head, seq))

    def _ours(self, prompt_id: str) -> bool:
        return self.feeder is None or self.feeder.owns(prompt_id)

    def state_dict(self) -> dict[str, Any]:
        return {"trained": sorted(self.trained), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trained = set(state["trained"])
        self.counts = Counter(state["counts"])
