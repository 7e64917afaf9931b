"""The replay's group source (`GroupSource`, `services/trainer/intake/source.py`): recorded messages ->
the trainer's batches.

Every message goes through the trainer's own `Intake.judge` (same duplicate rule, same counters,
checkpointed with the trainer; the group decoded ahead, several at a time, to exactly what the codec
gives), so replay trains exactly what the live trainer would take from those messages. Before that,
the range's filters run on the headers alone: rejection markers and groups outside the version range
are skipped and counted. A corrupted message is logged with its sequence, counted
(`malformed_messages`) and skipped; the replay goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from schemas.headers import is_rejection
from schemas.subjects import HDR_HEAD_VERSION, HDR_TAIL_VERSION
from schemas.trajectory import DecodedGroup, TrajectoryError, decode_group
from services.common.busretry import RetryPolicy
from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher
from services.replay.decode import decode_ahead
from services.replay.parquet import iter_records
from services.replay.reader import Record, StreamReader
from services.replay.settings import RangeSettings, ReplaySettings
from services.trainer.intake.source import Collected
from services.trainer.versions import VersionWindow

if TYPE_CHECKING:
    from services.trainer.intake.intake import Group, Intake

log = get_logger("replay")

#: staleness "off": an eta no version gap reaches
ETA_OFF = sys.maxsize // 2


def replay_window(settings: ReplaySettings) -> VersionWindow:
    """The replay trainer's version window: staleness "off" takes an eta nothing in the recording is too
    old for; "live" and "recorded" judge with the trainer's eta."""
    return VersionWindow(ETA_OFF if settings.staleness == "off" else settings.eta)


def _int_header(headers: dict[str, str] | None, name: str) -> int | None:
    try:
        return int((headers or {})[name])
    except (KeyError, ValueError):
        return None


def versions_of(record: Record) -> tuple[int, int] | None:
    """(head, tail) from the headers, or from the body when they are missing; None if neither says."""
    head, tail = _int_header(record.headers, HDR_HEAD_VERSION), _int_header(record.headers, HDR_TAIL_VERSION)
    if head is not None and tail is not None:
        return head, tail
    try:
        meta = (record.decoded if isinstance(record.decoded, DecodedGroup) else decode_group(record.data)).meta
    except TrajectoryError:
        return None
    return meta.head_version, meta.tail_version


def skip_reason(record: Record, rng: RangeSettings) -> str | None:
    """Why a record is not offered to the trainer, or None. Decides on headers only (cheap)."""
    if is_rejection(record.headers):
        return "rejection"
    if rng.min_version is None and rng.max_version is None:
        return None
    versions = versions_of(record)
    if versions is None:
        return None  # no readable versions: the intake will call it malformed
    head, tail = versions
    if rng.min_version is not None and head < rng.min_version:
        return "version"
    if rng.max_version is not None and tail > rng.max_version:
        return "version"
    return None


def open_records(settings: ReplaySettings, js: JetStreamContext, start_after: int,
                 retry: RetryPolicy | None = None) -> AsyncIterator[Record]:
    """The range's recorded messages after `start_after`, from Parquet files if given, else from the
    stream (`retry`: the service's retry policy); each pull's (or as many Parquet) groups decoded together."""
    if settings.parquet:
        records = iter_records(settings.parquet, settings.range, run=settings.source_run, start_after=start_after)
        return decode_ahead(as_batches(records, settings.fetch_batch))
    assert settings.source_run is not None
    reader = StreamReader(js, settings.source_run, settings.range, start_after=start_after,
                          batch=settings.fetch_batch, fetch_timeout_s=settings.fetch_timeout_s, retry=retry)
    return decode_ahead(reader.batches())


async def as_batches(records: Iterable[Record], size: int) -> AsyncGenerator[list[Record], None]:
    it = iter(records)
    while batch := list(itertools.islice(it, size)):
        yield batch
        await asyncio.sleep(0)  # a long Parquet read must not starve the event loop


class RecordingSource:
    """`Trainer(..., source=lambda intake: RecordingSource(settings, intake))`: batches from recorded
    messages instead of the trainer's durable consumer, judged through the trainer's intake (whose
    versions are the recorded run's: the trainer is not live). `collect` returns None once the range
    is exhausted."""

    def __init__(self, settings: ReplaySettings, intake: Intake, *, records: AsyncIterator[Record] | None = None,
                 retry: RetryPolicy | None = None) -> None:
        """`records`: already open (a bench); None: `open` reads the range from the resume point on;
        `retry`: the service's retry policy (`Bus.retry`) for reading the stream."""
        self.settings = settings
        self.retry = retry
        self.intake = intake
        self.records = records
        self.rng = settings.range
        self.staleness = settings.staleness
        self.drop_last = settings.drop_last
        self.batch_groups = settings.batch_groups
        self.metrics: MetricsPublisher | None = None
        self.read_seq = 0
        """The highest sequence read (each collect returns it as its `last_seq`)."""
        self.recorded_version = 0
        """Newest weight version seen in the recording so far (the live trainer was at least there)."""
        self.exhausted = False
        self.skipped: dict[str, int] = {"rejection": 0, "version": 0}
        self.malformed = 0
        self.read = 0

    async def open(self, nc: NATS, metrics: MetricsPublisher | None, after_seq: int) -> None:
        """Read the range after the checkpoint's last consumed sequence (0: from its start)."""
        self.metrics, self.read_seq = metrics, after_seq
        if self.records is None:
            self.records = open_records(self.settings, nc.jetstream(), after_seq, self.retry)

    async def applied(self) -> None:
        """Nothing to acknowledge: a recording is read, not consumed."""

    async def close(self) -> None:
        """Nothing held open between steps."""

    def judge(self, record: Record, version: int) -> Group | None:
        """One record through the range filters and the intake: its group, or None (counted)."""
        self.read += 1
        reason = skip_reason(record, self.rng)
        if reason is not None:
            self.skipped[reason] += 1
            return None
        tail = _int_header(record.headers, HDR_TAIL_VERSION)
        if tail is not None:
            self.recorded_version = max(self.recorded_version, tail)
        reference = self.recorded_version if self.staleness == "recorded" else version
        verdict = self.intake.judge(record.data, record.headers, record.seq, reference, decoded=record.decoded)
        if verdict.outcome == "malformed":
            self.malformed += 1
            log.error("corrupted message in the recording skipped", subject=record.subject, stream_seq=record.seq,
                      prompt_id=verdict.prompt_id, error=verdict.error)
        return verdict.group

    async def collect(self, version: int, stopping: asyncio.Event | None = None) -> Collected | None:
        """The next batch of `batch_groups` accepted groups; a shorter last one unless drop_last; None at the end."""
        groups: list[Group] = []
        before = self.malformed
        while len(groups) < self.batch_groups and not self.exhausted:
            if stopping is not None and stopping.is_set():
                return None  # last_seq stays at the last trained batch: a resume re-reads these
            if self.records is None:
                raise RuntimeError("replay source: no recording opened before the first step")
            record = await anext(self.records, None)
            if record is None:
                self.exhausted = True
                break
            group = self.judge(record, version)
            self.read_seq = max(self.read_seq, record.seq)
            if group is not None:
                groups.append(group)
        if self.metrics is not None:
            self.metrics.count("malformed_messages", self.malformed - before)
        if not groups or (self.drop_last and len(groups) < self.batch_groups):
            return None
        return Collected(groups, self.read_seq)
