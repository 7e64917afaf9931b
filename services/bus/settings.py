"""Settings of `jetrl bus init`: the admin step that declares the bus for restricted service users."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from services.common.settings import ServiceSettings


class BusSettings(ServiceSettings):
    service: ClassVar[str] = "bus"

    trajectories_max_bytes: int = Field(-1, ge=-1)
    """Size cap of the TRAJECTORIES stream, bytes (-1: none; the oldest messages go first)."""
    trajectories_max_age_s: float = Field(0.0, ge=0)
    """Age cap of the TRAJECTORIES stream, seconds (0: kept forever: the recording)."""
    trajectories_discard: Literal["old", "new"] = "old"
    """What the recording does at `trajectories_max_bytes`: old: the oldest groups are dropped (the
    recording keeps the latest); new: new groups are refused (the rollout workers' publishes fail and
    say so, naming TRAJECTORIES) until the cap is raised or the stream purged: nothing recorded is lost."""
    metrics_max_age_s: float = Field(7 * 24 * 3600.0, ge=0)
    """Age cap of the METRICS stream, seconds."""
