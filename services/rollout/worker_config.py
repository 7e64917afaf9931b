"""`WorkerConfig`: what a rollout worker (`worker.py`) runs with, taken from `RolloutSettings` field by field
(`service.py`), or given directly by tests and benches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    worker: str
    max_concurrent: int = 16
    max_deliver: int = 3
    ack_wait_s: float = 60.0
    nak_delay_s: float = 2.0
    publish_timeout_s: float = 10.0
    fetch_timeout_s: float = 1.0
    max_ack_pending: int = 10_000
    drain_timeout_s: float = 10.0
    episode_timeout_s: float = 1800.0
    """Longest run of one episode; 0 = no limit."""
    fail_fast_after: int = 0
    """Failed episode attempts, none having succeeded yet, after which the worker stops; 0: never."""
    version_poll_s: float = 0.5
    """While a prompt waits for its `min_version`, re-read the servers' versions this often (a load
    report on `weights.loaded` wakes it at once)."""
    servable_poll_s: float = 0.1
    """At start, until a server serves, ask them this often."""
