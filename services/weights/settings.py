"""Settings of `jetrl weights`, the agent beside one inference server."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from services.common.settings import ServiceSettings


class WeightsSettings(ServiceSettings):
    service: ClassVar[str] = "weights"

    server: str = "http://127.0.0.1:30000"
    """Base URL of the inference server this agent loads weights into."""
    name: str = ""
    """How this server is named in WeightsLoaded/WeightsLoadFailed and their subjects; default: `server`."""
    cache_dir: str = ".jetrl/weights-cache"
    """Where versions fetched from the object store are written (one `v<N>` directory each)."""
    keep_local: int = 2
    """Versions kept in `cache_dir` (the loaded one always among them); older ones are deleted."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """`/pause_generation` mode: abort returns in-flight requests with their partial tokens."""
    request_timeout_s: float = 300.0
    """Timeout of each HTTP call to the server (`/update_weights_from_disk` of a large model is slow)."""
    server_ready_timeout_s: float = 600.0
    """How long to wait at start for the server's `/health` to answer 200."""
    report_retry_s: float = Field(120.0, ge=0)
    """How long a WeightsLoaded/WeightsLoadFailed report is retried while NATS does not acknowledge it
    (a server restarting); then it is logged and counted as report_failures, and the agent goes on."""
    bus_retry_timeout_s: float = Field(300.0, gt=0)
    """How long a download from the object store is retried through a NATS outage (each file resumed
    after its last chunk written) before that version's load fails; the announcement listener keeps
    retrying for as long as NATS is away."""
    chunk_timeout_s: float = Field(30.0, gt=0)
    """Longest wait for one batch of object chunks, per attempt; then the download is retried."""
    weight_roots: list[str] = []
    """Where announced weights may live: `file:///dir` (versions anywhere under that directory) or
    `nats-os://BUCKET[/prefix]`. An announcement naming anything else is refused before a file is read
    or the server paused (`refused_outside_roots`). Empty: this run's versions in the WEIGHTS bucket,
    where the trainer publishes unless its `weights` go to a shared directory (`weights.dir`, `weights.disk_dir`: then list it)."""

    @field_validator("keep_local")
    @classmethod
    def _keep_one(cls, v: int) -> int:
        if v < 1:
            raise ValueError("keep_local must be >= 1: the loaded version stays on disk")
        return v

    @field_validator("server")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"server {v!r}: expected an http(s):// base URL")
        return v.rstrip("/")

    @property
    def server_name(self) -> str:
        return self.name or self.server
