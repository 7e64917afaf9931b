"""The trainer's version window: the one owner of the numbers that say which weights a group may be
generated with to be trained, and which a prompt may ask for. The intake (`intake/intake.py`, which
judges groups) and the feeder's ledger (`feed/ledger.py`, which admits prompts) read it; the trainer
(`loop.py`) moves it: a step, a fresh start on a used run name, a resume behind announced versions,
a restore from a checkpoint. Nothing else writes it.

- `version`: the weights the trainer holds now (checkpointed as `jetrl_version`).
- `first_version`: the version of this run's base weights: 0, or N+1 when an earlier trainer of the run
  name announced N (`feed/fresh.py`); the run's step count is `version - first_version`.
- `own_from`: the oldest weights a group may be generated with, when above `first_version`: the number
  a trainer resumed behind the versions it announced gave its restored weights (`loop.py` `_catch_up`).
- `eta`: the staleness budget, versions a group's oldest trained token may lag the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class VersionWindow:
    eta: int
    """A group is trained while its oldest trained token is at most `eta` versions older than the trainer."""
    version: int = 0
    """The trainer's weight version now."""
    first_version: int = 0
    """The version of this run's base weights (module doc); checkpointed."""
    own_from: int = 0
    """The oldest weights a group of this run may be generated with, when above `first_version`; checkpointed."""

    @property
    def steps(self) -> int:
        """Steps this run trained: the version, less the one it started from."""
        return self.version - self.first_version

    @property
    def oldest_own(self) -> int:
        """Groups generated with weights older than this are an earlier run's or a killed trainer's."""
        return max(self.first_version, self.own_from)

    def advance(self) -> None:
        """A step was applied: the trainer holds the next version."""
        self.version += 1

    def continue_from(self, first_version: int) -> None:
        """A fresh start on a run name whose earlier trainer announced `first_version - 1`: this run's base
        weights are `first_version`, and its steps count from there."""
        self.version = self.first_version = first_version

    def resume_behind(self, version: int) -> int:
        """Resumed from a checkpoint older than the versions the killed trainer announced: the restored
        weights are numbered `version`, the step count goes on (the first version moves as much), and no
        group generated with older weights is this trainer's. Returns how far the numbering moved."""
        delta = version - self.version
        self.version = version
        self.first_version += delta
        self.own_from = version
        return delta

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps beside `jetrl_version` (saved with the intake's state, where a
        checkpoint written before this class has them too)."""
        state: dict[str, Any] = {}
        if self.first_version:
            state["first_version"] = self.first_version
        if self.own_from:
            state["own_from"] = self.own_from
        return state

    def load_state_dict(self, version: int, state: dict[str, Any]) -> None:
        """Restore from a checkpoint (a checkpoint from before a continued numbering: versions from 0)."""
        self.version = version
        self.first_version = int(state.get("first_version", 0))
        self.own_from = int(state.get("own_from", 0))
