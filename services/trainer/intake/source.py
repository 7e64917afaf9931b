"""Where a step's groups come from: `GroupSource`, implemented by the live durable consumer
(`consumer.py`) and by a recording (`services/replay/source.py`, `jetrl replay`). Both judge each message
through the same `Intake`; the trainer (`loop.py`) drives either the same way and keeps its own
`last_seq`: a source returns what it read, it writes no field of the trainer.

The loop a source serves, one step:

    collected = await source.collect(window.version, stopping)   # None: stopping, or nothing more
    ... train collected.groups, then the step is applied ...
    trainer.last_seq = max(trainer.last_seq, collected.last_seq)
    await source.applied()                                       # acknowledge what the step trained
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from nats.aio.client import Client as NATS

from services.common.metrics import MetricsPublisher
from services.trainer.intake.intake import Group


@dataclass(frozen=True)
class Collected:
    """One step's groups, and the stream sequence every message read for them is at or before."""

    groups: list[Group]
    last_seq: int


class GroupSource(Protocol):
    @property
    def exhausted(self) -> bool:
        """No group will come any more (the end of a recording; a live consumer: never)."""
        ...

    async def open(self, nc: NATS, metrics: MetricsPublisher | None, after_seq: int) -> None:
        """Start reading right after stream sequence `after_seq` (0: from the start)."""
        ...

    async def collect(self, version: int, stopping: asyncio.Event | None = None) -> Collected | None:
        """The next step's groups, judged at the trainer's `version`; None if stopping first or if no
        (full) batch is left."""
        ...

    async def applied(self) -> None:
        """The step training the last collected groups was applied: settle their messages."""
        ...

    async def close(self) -> None:
        """Stop reading (before the connection is drained)."""
        ...
