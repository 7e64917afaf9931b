"""The prompt feeder: dataset epochs in a seeded order, and the admission rule of DESIGN.md
"Staleness" applied at the source.

At version v with B groups per step and staleness budget eta, a prompt is issued only while
    issued - rejected <= (eta + v + 1) * B     and     issued - accepted - rejected <= max_in_flight
hold after issuing it. A rejected prompt (rejection marker, stale or zero-variance group, dead letter)
is re-issued under a new prompt_id `<epoch>-<index>-r<k>`. The whole state is JSON, saved in checkpoints.
"""

from __future__ import annotations

import json
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.messages import PromptTask


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL or Parquet dataset; errors name the file and line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected an object, got {type(row).__name__}")
            rows.append(row)
    if not rows:
        raise ValueError(f"dataset {path} has no rows")
    return rows


@dataclass
class FeederCounters:
    issued: int = 0
    accepted: int = 0
    rejected: int = 0
    reissued: int = 0
    eval_issued: int = 0

    @property
    def in_flight(self) -> int:
        return self.issued - self.accepted - self.rejected


@dataclass
class Feeder:
    run: str
    rows: list[dict[str, Any]]
    batch_groups: int
    eta: int
    max_in_flight: int
    seed: int = 0
    epochs: int = 0
    shuffle: bool = True
    eval_rows: list[dict[str, Any]] = field(default_factory=list)
    counters: FeederCounters = field(default_factory=FeederCounters)
    epoch: int = 0
    index: int = 0
    in_flight: dict[str, list[int]] = field(default_factory=dict)
    """prompt_id -> [epoch, row, attempt] for every issued, unanswered training prompt."""
    reissue: deque[list[int]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self._order_epoch = -1
        self._order: list[int] = []

    # -------------------------------------------------------------------------------- admission

    def bound(self, version: int) -> int:
        return (self.eta + version + 1) * self.batch_groups

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

    def next_task(self, version: int) -> PromptTask | None:
        """The next prompt to publish if the admission rule allows one, counted as issued."""
        if not self.admissible(version):
            return None
        if self.reissue:
            epoch, row, attempt = self.reissue.popleft()
            self.counters.reissued += 1
        elif not self.dataset_done:
            epoch, row, attempt = self.epoch, self._row_order(self.epoch)[self.index], 0
            self.index += 1
            if self.index >= len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
        else:
            return None
        prompt_id = f"{epoch}-{row}" + (f"-r{attempt}" if attempt else "")
        self.in_flight[prompt_id] = [epoch, row, attempt]
        self.counters.issued += 1
        return PromptTask(run=self.run, prompt_id=prompt_id, data=self.rows[row], issued_version=version)

    # -------------------------------------------------------------------------------- answers

    def on_accepted(self, prompt_id: str) -> bool:
        """A group of this prompt was trained on. False if the prompt was not ours or already answered."""
        if self.in_flight.pop(prompt_id, None) is None:
            return False
        self.counters.accepted += 1
        return True

    def on_rejected(self, prompt_id: str) -> bool:
        """The prompt yielded nothing trainable: count it and queue the row again under a new id."""
        entry = self.in_flight.pop(prompt_id, None)
        if entry is None:
            return False
        self.counters.rejected += 1
        epoch, row, attempt = entry
        self.reissue.append([epoch, row, attempt + 1])
        return True

    def eval_tasks(self, step: int, size: int, version: int) -> list[PromptTask]:
        rows = self.eval_rows[:size]
        self.counters.eval_issued += len(rows)
        return [
            PromptTask(run=self.run, prompt_id=f"eval{step}-{i}", data=row, is_eval=True, issued_version=version)
            for i, row in enumerate(rows)
        ]

    # -------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {
            "counters": vars(self.counters).copy(),
            "epoch": self.epoch,
            "index": self.index,
            "in_flight": dict(self.in_flight),
            "reissue": list(self.reissue),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters = FeederCounters(**state["counters"])
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.in_flight = {k: list(v) for k, v in state["in_flight"].items()}
        self.reissue = deque(list(x) for x in state["reissue"])
