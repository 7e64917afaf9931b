"""The feeder's ledger: dataset epochs in a seeded order, and the admission rule of docs/design.md
"Staleness" applied at the source. Pure bookkeeping, saved in checkpoints; the bus side is `feeder.py`.

At version v with B groups per step and staleness budget eta, a prompt is issued only while
    issued - rejected <= (eta + v + 1) * B     and     issued - accepted - rejected <= max_in_flight
hold after issuing it. A prompt that yields nothing trainable is re-issued under a new prompt_id
`<epoch>-<index>-r<k>` (k: the row's k-th re-issue). A genuine failure (rejection marker, malformed
answer, dead letter, no answer within `in_flight_timeout_s`) is charged to the row: after
`max_attempts` of them the row is dropped, counted by cause and logged. A stale group is not the row's
fault (the weights were old, not the prompt bad): it is re-issued uncharged, as often as it takes.
A group removed by dynamic filtering (all rewards equal: nothing to learn) frees its slot but is not
re-issued, as in AReaL. The whole state is JSON, saved in checkpoints.

Every prompt carries `min_version`, the oldest weight version its group may be generated with and
still be accepted: a rollout worker holds the prompt until its servers hold that version, so no group
is generated with weights the trainer will refuse (docs/rollout.md "Version gating"). A prompt that is
the n-th in line (issued - rejected) is expected to be trained at step `(n - 1) // B`; accepted there
if its oldest token is at most eta versions older, so `min_version = (n - 1) // B - eta`, never above
the current version (the admission rule guarantees that) nor below 0.

Versions count from `first_version`: 0, or N+1 for a fresh start on a run name whose earlier trainer
announced version N (`fresh.py`). The rules above then read `v - first_version` for `v` (the trainer's
steps so far), and `min_version` is `first_version` plus the expression above: no prompt of this run
is ever generated with the earlier run's weights. Eta, `first_version` and `own_from` are read from
the trainer's version window (`versions.py`), which the trainer alone moves.

A trainer resumed behind the version it announced before it was killed moves `first_version` by as
much as its own version (the step count goes on) and sets `own_from`, the number of its restored
weights: no prompt asks for older ones; the ledger sets the killed incarnation's prompts apart
(`resume_behind`).

Prompt ids end in `.<tag>` when the trainer was given a tag (a fresh start on a run name that was used
before): results of the earlier incarnation's prompts then never match ours, and JetStream's
de-duplication by `Nats-Msg-Id` cannot drop our results as repeats of theirs.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from schemas.messages import PromptTask
from services.common.logging import get_logger
from services.trainer.versions import VersionWindow

log = get_logger("trainer.feeder")


FAILURE_CAUSES = ("rejected", "malformed", "dead_letter", "timed_out")
"""The genuine failures of a prompt the trainer knows, each charged to its row (`max_attempts`): a
rejection marker, a malformed answer, a dead letter, no answer within `in_flight_timeout_s`. Any
other cause a caller names is counted under its own name."""


@dataclass
class FeederCounters:
    issued: int = 0
    accepted: int = 0
    rejected: int = 0
    """Prompts answered with nothing trainable: failures, stale and filtered groups (frees the slot)."""
    reissued: int = 0
    eval_issued: int = 0
    filtered: int = 0
    """Groups removed by dynamic filtering (counted in `rejected` too; not re-issued)."""
    stale: int = 0
    """Groups judged stale (counted in `rejected` too); their rows are re-issued uncharged."""
    dropped: int = 0
    """Rows given up after `max_attempts` genuine failures."""
    dropped_by_cause: dict[str, int] = field(default_factory=dict)
    """Dropped rows by the cause of their last failure."""
    timed_out: int = 0
    """Prompts unanswered for `in_flight_timeout_s`, treated as failed."""

    @property
    def in_flight(self) -> int:
        return self.issued - self.accepted - self.rejected


@dataclass
class PromptLedger:
    run: str
    rows: list[dict[str, Any]]
    batch_groups: int
    window: VersionWindow
    """The trainer's version window: eta, `first_version`, `own_from` (read only)."""
    max_in_flight: int
    seed: int = 0
    epochs: int = 0
    shuffle: bool = True
    eval_rows: list[dict[str, Any]] = field(default_factory=list)
    max_attempts: int = 3
    in_flight_timeout_s: float = 1800.0
    tag: str = ""
    """Appended to every training prompt id as `.<tag>` (empty: nothing appended); saved in checkpoints."""
    gate_versions: bool = True
    """False: every prompt carries `min_version` 0 (a trainer that publishes no weights: no server will
    ever load a newer version, so nothing may wait for one)."""
    counters: FeederCounters = field(default_factory=FeederCounters)
    epoch: int = 0
    index: int = 0
    in_flight: dict[str, list[int]] = field(default_factory=dict)
    """prompt_id -> [epoch, row, failures, reissue] for every issued, unanswered training prompt:
    failures charged to the row so far, and how many times the row was issued before (its id's `-r<k>`)."""
    reissue: deque[list[int]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self._order_epoch = -1
        self._order: list[int] = []
        self._issued_at: dict[str, float] = {}
        """prompt_id -> monotonic time of issue; not saved: a resume restarts every clock."""
        self._unconfirmed: set[str] = set()
        """Issued prompts whose publish is not acknowledged yet; saved as not issued."""

    # -------------------------------------------------------------------------------- admission

    def bound(self, version: int) -> int:
        w = self.window
        return (w.eta + version - w.first_version + 1) * self.batch_groups

    def admissible(self, version: int) -> bool:
        c = self.counters
        return c.issued + 1 - c.rejected <= self.bound(version) and c.in_flight + 1 <= self.max_in_flight

    @property
    def dataset_done(self) -> bool:
        return self.epochs > 0 and self.epoch >= self.epochs

    @property
    def exhausted(self) -> bool:
        """Nothing left to issue and nothing awaited: training can end."""
        return self.dataset_done and not self.reissue and not self.in_flight

    def _row_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            self._order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(self._order)
            self._order_epoch = epoch
        return self._order

    def prompt_id(self, epoch: int, row: int, attempt: int) -> str:
        return f"{epoch}-{row}" + (f"-r{attempt}" if attempt else "") + (f".{self.tag}" if self.tag else "")

    def owns(self, prompt_id: str) -> bool:
        """Whether `prompt_id` can be one of ours (always, unless a tag sets ours apart)."""
        return not self.tag or prompt_id.endswith(f".{self.tag}")

    def next_task(self, version: int) -> PromptTask | None:
        """The next prompt to publish if the admission rule allows one, counted as issued. Until
        `confirm`, a checkpoint saves it as not issued; `put_back` undoes the issue."""
        if not self.admissible(version):
            return None
        if self.reissue:
            epoch, row, failures, k = self.reissue.popleft()
            if k:  # k 0: a put-back first issue
                self.counters.reissued += 1
        elif not self.dataset_done:
            epoch, row, failures, k = self.epoch, self._row_order(self.epoch)[self.index], 0, 0
            self.index += 1
            if self.index >= len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
        else:
            return None
        min_version = self.min_version(version)
        prompt_id = self.prompt_id(epoch, row, k)
        self.in_flight[prompt_id] = [epoch, row, failures, k]
        self._issued_at[prompt_id] = time.monotonic()
        self._unconfirmed.add(prompt_id)
        self.counters.issued += 1
        return PromptTask(run=self.run, prompt_id=prompt_id, data=self.rows[row], issued_version=version,
                          min_version=min_version)

    def min_version(self, version: int) -> int:
        """The oldest weights the next prompt may be generated with (module doc): the version of the
        step that is expected to train it, less eta."""
        if not self.gate_versions:
            return 0
        c, w = self.counters, self.window
        expected_step = (c.issued - c.rejected) // self.batch_groups
        return max(w.own_from, w.first_version + max(0, min(version - w.first_version, expected_step - w.eta)))

    def resume_behind(self, tag: str) -> None:
        """The trainer resumed behind the version it announced before it was killed, and moved its
        version window past the lost versions (`VersionWindow.resume_behind`). Everything the killed
        incarnation's prompts produce is set apart: prompt ids take the new `tag`, so their answers are
        foreign and JetStream's de-duplication cannot drop the new prompts and answers as repeats of
        those, and every prompt in flight is counted stale and goes out again, uncharged (answered, if
        at all, with weights that are gone)."""
        for prompt_id in list(self.in_flight):
            self.on_stale(prompt_id)
        self.tag = tag

    def confirm(self, prompt_id: str) -> None:
        """The prompt's publish was acknowledged: it is in the work queue."""
        self._unconfirmed.discard(prompt_id)

    def put_back(self, prompt_id: str) -> None:
        """The publish failed: undo the issue; the row goes out next, under the same id."""
        entry = self.in_flight.pop(prompt_id, None)
        self._issued_at.pop(prompt_id, None)
        self._unconfirmed.discard(prompt_id)
        if entry is None:
            return
        self.counters.issued -= 1
        if entry[3]:
            self.counters.reissued -= 1
        self.reissue.appendleft(entry)

    # -------------------------------------------------------------------------------- answers

    def _close(self, prompt_id: str) -> list[int] | None:
        self._issued_at.pop(prompt_id, None)
        self._unconfirmed.discard(prompt_id)
        return self.in_flight.pop(prompt_id, None)

    def on_accepted(self, prompt_id: str) -> bool:
        """A group of this prompt was trained on. False if the prompt was not ours or already answered."""
        if self._close(prompt_id) is None:
            return False
        self.counters.accepted += 1
        return True

    def on_rejected(self, prompt_id: str, cause: str = "rejected") -> bool:
        """The prompt failed (`cause`: see FAILURE_CAUSES): charge its row and queue it again under a
        new id, unless that was the row's `max_attempts`-th failure; then drop it, counted by cause."""
        entry = self._close(prompt_id)
        if entry is None:
            return False
        self.counters.rejected += 1
        epoch, row, failures, k = entry
        if failures + 1 < self.max_attempts:
            self.reissue.append([epoch, row, failures + 1, k + 1])
        else:
            self.counters.dropped += 1
            by_cause = self.counters.dropped_by_cause
            by_cause[cause] = by_cause.get(cause, 0) + 1
            log.warning("row dropped after max_attempts failures", prompt_id=prompt_id, epoch=epoch, row=row,
                        cause=cause, failures=failures + 1, issues=k + 1)
        return True

    def on_stale(self, prompt_id: str) -> bool:
        """The prompt's group was generated with weights too old to train on: not the row's fault.
        Free the slot and queue the row again, uncharged (its `min_version` is set anew at re-issue)."""
        entry = self._close(prompt_id)
        if entry is None:
            return False
        self.counters.rejected += 1
        self.counters.stale += 1
        epoch, row, failures, k = entry
        self.reissue.append([epoch, row, failures, k + 1])
        return True

    def on_filtered(self, prompt_id: str) -> bool:
        """The group had nothing to learn from (all rewards equal): free the slot, do not re-issue."""
        if self._close(prompt_id) is None:
            return False
        self.counters.rejected += 1
        self.counters.filtered += 1
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Treat prompts unanswered for `in_flight_timeout_s` as rejected (a dead-letter advisory sent
        while the trainer was down, a prompt lost with the server's store, ...); returns their ids."""
        now = time.monotonic() if now is None else now
        expired = [pid for pid, t in self._issued_at.items() if now - t >= self.in_flight_timeout_s]
        for pid in expired:
            log.warning("in-flight prompt timed out; treated as failed", prompt_id=pid, timeout_s=self.in_flight_timeout_s)
            self.counters.timed_out += 1
            self.on_rejected(pid, "timed_out")
        return expired

    def eval_tasks(self, step: int, size: int, version: int, nonce: str) -> list[PromptTask]:
        """The eval round after `step`: ids `eval<step>-<i>.<nonce>`, with a nonce per trainer process,
        so a round issued again after a resume is not de-duplicated against the earlier one's results."""
        rows = self.eval_rows[:size]
        self.counters.eval_issued += len(rows)
        return [
            PromptTask(run=self.run, prompt_id=f"eval{step}-{i}.{nonce}", data=row, is_eval=True, issued_version=version,
                       min_version=version if self.gate_versions else 0)
            for i, row in enumerate(rows)
        ]

    def metric_values(self) -> dict[str, float]:
        """Every counter as `feeder_<name>` (the trainer's metrics; `jetrl status` reads them)."""
        c = self.counters
        values = {f"feeder_{k}": float(v) for k, v in vars(c).items() if isinstance(v, int)}
        values["feeder_in_flight"] = float(c.in_flight)
        for cause in {*FAILURE_CAUSES, *c.dropped_by_cause}:
            values[f"feeder_dropped_{cause}"] = float(c.dropped_by_cause.get(cause, 0))
        return values

    # -------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The state as if every unconfirmed publish had failed: a prompt that may never have reached
        the work queue is not saved as in flight (it would hold its slot forever after a resume)."""
        saved = PromptLedger(self.run, self.rows, self.batch_groups, self.window, self.max_in_flight, tag=self.tag)
        saved.counters = FeederCounters(**{**vars(self.counters), "dropped_by_cause": dict(self.counters.dropped_by_cause)})
        saved.in_flight, saved.reissue = dict(self.in_flight), deque(self.reissue)
        for pid in self._unconfirmed:
            saved.put_back(pid)
        return {
            "counters": vars(saved.counters).copy(),
            "epoch": self.epoch,
            "index": self.index,
            "in_flight": saved.in_flight,
            "reissue": list(saved.reissue),
            "tag": self.tag,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters = FeederCounters(**{**state["counters"], "dropped_by_cause": dict(state["counters"].get("dropped_by_cause", {}))})
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.in_flight = {k: _entry(v) for k, v in state["in_flight"].items()}
        self.reissue = deque(_entry(x) for x in state["reissue"])
        self.tag = str(state.get("tag", ""))
        now = time.monotonic()
        self._issued_at = dict.fromkeys(self.in_flight, now)
        self._unconfirmed = set()


def _entry(saved: list[int]) -> list[int]:
    """A saved in-flight or re-issue entry; one saved before stale re-issues were uncharged is
    [epoch, row, attempt], every issue of it a failure."""
    return [*saved, saved[2]] if len(saved) == 3 else list(saved)
