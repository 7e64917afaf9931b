"""Settings of `jetrl status`."""

from __future__ import annotations

from typing import ClassVar, Literal

from services.common.settings import ServiceSettings


class StatusSettings(ServiceSettings):
    service: ClassVar[str] = "status"

    format: Literal["table", "json"] = "table"
    """table: readable text; json: one JSON object (for scripts)."""
    timeout_s: float = 5.0
    """How long to wait for NATS and for the stream reads."""
    run_dir: str = "runs"
    """Where `jetrl up` keeps runs: a live run's NATS address is read from <run_dir>/<run>/nats.url
    unless nats_url is set."""
    alive_within_s: float = 30.0
    """A worker whose last metrics event is older than this is shown as silent."""
