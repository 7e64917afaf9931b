"""Settings of `jetrl replay`, `jetrl export` and `jetrl import` (`--help` lists them with these docs).

A replay is the trainer in offline mode, so `ReplaySettings` is `TrainerSettings` (same algorithm,
same engine, same checkpoints; a trainer config file works unchanged) plus where the groups come from.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from schemas.subjects import check_run
from services.common.settings import Section, ServiceSettings, flag
from services.trainer.settings import FeederSettings, TrainerSettings
from services.weights.sender.settings import NoSync, WeightSyncSettings


class RangeSettings(Section):
    """Which part of a recording is read, in stream order."""

    from_seq: int = Field(0, ge=0, json_schema_extra=flag("--from-seq"))
    """First stream sequence of the range (0: from the start, or from `since`)."""
    to_seq: int = Field(0, ge=0, json_schema_extra=flag("--to-seq"))
    """Last stream sequence of the range, inclusive (0: no bound)."""
    since: datetime | None = Field(None, json_schema_extra=flag("--since"))
    """First message time of the range (ISO 8601; naive times are UTC)."""
    until: datetime | None = Field(None, json_schema_extra=flag("--until"))
    """Last message time of the range, inclusive (ISO 8601; naive times are UTC)."""
    min_version: int | None = Field(None, json_schema_extra=flag("--min-version"))
    """Keep only groups whose oldest token came from this weight version or a later one."""
    max_version: int | None = Field(None, json_schema_extra=flag("--max-version"))
    """Keep only groups whose newest token came from this weight version or an earlier one."""
    kind: Literal["train", "eval", "all"] = Field("train", json_schema_extra=flag("--kind"))
    """Which trajectories: the training subject, the eval subject, or both."""
    follow: bool = Field(False, json_schema_extra=flag("--follow"))
    """False: the range ends at the last message present when reading starts (or earlier, at to_seq /
    until). True: keep waiting for a live run's new messages until to_seq / until is passed (forever
    without them)."""

    @field_validator("since", "until")
    @classmethod
    def _utc(cls, v: datetime | None) -> datetime | None:
        return v.replace(tzinfo=UTC) if v is not None and v.tzinfo is None else v

    @model_validator(mode="after")
    def _check(self) -> RangeSettings:
        if self.to_seq and self.from_seq > self.to_seq:
            raise ValueError(f"from_seq {self.from_seq} is after to_seq {self.to_seq}")
        if self.since and self.until and self.since > self.until:
            raise ValueError(f"since {self.since.isoformat()} is after until {self.until.isoformat()}")
        if self.from_seq and self.since:
            raise ValueError("give the start as from_seq or as since, not both")
        if self.min_version is not None and self.max_version is not None and self.min_version > self.max_version:
            raise ValueError(f"min_version {self.min_version} is above max_version {self.max_version}")
        return self


class ReplaySettings(TrainerSettings):
    """The trainer with no feeder, no inference and no weight agents, reading a recorded range."""

    service = "replay"

    source_run: str | None = Field(None, json_schema_extra=flag("--source-run"))
    """The recorded run to read (its trajectory subjects); `run` names this offline run, under which its
    metrics go. Required when reading the stream; with `parquet`, only rows of this run are read if set."""
    parquet: list[str] = Field(default_factory=list)
    """Parquet files or directories written by `jetrl export`; when set, replay reads them instead of the stream."""
    range: RangeSettings = RangeSettings()
    staleness: Literal["off", "recorded"] = "off"
    """off: every group in the range is trained, however old its tokens; recorded: a group is dropped as
    stale when (newest version seen in the recording so far) - head_version > eta, as the live trainer would."""
    drop_last: bool = False
    """A final batch with fewer than batch_groups groups is trained (False) or dropped (True)."""
    output_dir: str = ".jetrl/replay"
    """Checkpoints, staged weight dirs and the step record (steps.jsonl) of this offline run."""
    publish_default: ClassVar[bool] = False
    weights: WeightSyncSettings = NoSync()
    """Publish the weights after every step under this run's name (`weights.transport`; none by
    default: nobody serves them)."""
    feeder: FeederSettings = FeederSettings(enabled=False)
    """Unused: replay has no feeder."""

    @field_validator("source_run")
    @classmethod
    def _source_is_token(cls, v: str | None) -> str | None:
        return check_run(v) if v is not None else v

    @model_validator(mode="after")
    def _replay_check(self) -> ReplaySettings:
        if self.feeder.enabled:
            raise ValueError("feeder.enabled: replay has no feeder (the groups come from the recording)")
        if not self.parquet and self.source_run is None:
            raise ValueError("source_run: name the recorded run to replay (or give parquet files)")
        if self.source_run == self.run:
            raise ValueError(f"run: the offline run needs its own name (it is the recorded run {self.run!r})")
        return self


class ExportSettings(ServiceSettings):
    """A recorded range of one run's trajectory stream -> one Parquet file."""

    service = "export"

    output: str = Field("trajectories.parquet", json_schema_extra=flag("--output"))
    """Parquet file to write (one row per sample; replaced if it exists)."""
    range: RangeSettings = RangeSettings(kind="all")
    """The range to export (by default training and eval groups alike)."""
    fetch_batch: int = Field(64, ge=1)
    """Messages per pull request."""
    row_group_rows: int = Field(8192, ge=1)
    """Samples per Parquet row group (groups are never split across row groups)."""
    compression: str = "zstd"
    """Parquet compression codec (zstd, snappy, gzip, none)."""


class ImportSettings(ServiceSettings):
    """Parquet written by `jetrl export` -> trajectory messages of `run`."""

    service = "import"

    input: list[str] = Field(default_factory=list)
    """Parquet files or directories to import, in order."""
    source_run: str | None = Field(None, json_schema_extra=flag("--source-run"))
    """Import only rows recorded by this run (None: every row)."""
    range: RangeSettings = RangeSettings(kind="all")
    """Rows to import, by their recorded sequence and time (by default training and eval groups alike)."""

    @model_validator(mode="after")
    def _check(self) -> ImportSettings:
        if not self.input:
            raise ValueError("input: give at least one Parquet file or directory")
        if self.range.follow:
            raise ValueError("range.follow: a Parquet file is not a live stream")
        return self
