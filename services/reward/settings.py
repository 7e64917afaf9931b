"""Settings of `jetrl reward` (env prefix `JETRL_REWARD__`)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import model_validator

from services.common.settings import ServiceSettings
from services.reward.allowlist import BUILTIN_REFS, AllowList


class RewardSettings(ServiceSettings):
    service = "reward"

    processes: int = 0
    """Worker processes in the scoring pool; 0 means one per CPU core."""
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    """How pool processes start. Never fork: the service is a threaded asyncio process."""
    allow: list[str] = []
    """Extra reward functions callers may name: exact `module:function` references, or a module
    prefix ending in `:*` (`mypkg.rewards:*`) or `.*:*` (`mypkg.*:*`, any submodule)."""
    allow_builtins: bool = True
    """Allow the built-in functions (services.reward.builtin:copy3, exact_match, numeric_match, math_verify)."""
    preload: list[str] = []
    """Modules each pool process imports at start (besides the modules of exact `allow` entries and
    the built-ins); else a process imports a function's module before its first batch of it (outside
    the items' timeouts, but on the request's time)."""
    item_timeout_s: float = 10.0
    """Per-item time limit when a request names none; the item's process is killed past it."""
    max_item_timeout_s: float = 120.0
    """Upper bound on the per-item timeout a request may ask for."""
    max_items: int = 4096
    """Most items one request may carry; a larger request is refused."""
    max_concurrent_requests: int = 64
    """Requests scored at once by this replica; further requests wait in the subscription."""
    slow_item_s: float = 1.0
    """An item running longer than this no longer counts against the pool: an item waiting behind it
    gets an extra process (see `max_extra_processes`), so hanging reward code does not hold the queue."""
    max_extra_processes: int = 4
    """Most processes started beyond `processes` for items waiting behind slow ones; each is stopped
    once idle with nothing waiting. 0 = a fixed pool (slow items then hold the queue up to their timeout)."""
    max_tasks_per_process: int = 0
    """Recycle a pool process after the batch in which it reaches this many items (guards against
    leaky reward code); 0 = never."""
    metrics_interval_s: float = 10.0
    """How often metrics go to the METRICS stream."""
    instance: str = ""
    """Name of this replica in logs and metrics (default: host-pid)."""

    @model_validator(mode="after")
    def _check(self) -> RewardSettings:
        if self.processes < 0:
            raise ValueError(f"processes must be >= 0 (0 = one per core), got {self.processes}")
        if not 0 < self.item_timeout_s <= self.max_item_timeout_s:
            raise ValueError(
                f"item_timeout_s ({self.item_timeout_s}) must be > 0 and <= max_item_timeout_s ({self.max_item_timeout_s})"
            )
        if self.max_items < 1 or self.max_concurrent_requests < 1:
            raise ValueError("max_items and max_concurrent_requests must be >= 1")
        if self.slow_item_s <= 0 or self.max_extra_processes < 0:
            raise ValueError(
                f"slow_item_s must be > 0 and max_extra_processes >= 0, got {self.slow_item_s} and {self.max_extra_processes}"
            )
        if self.metrics_interval_s <= 0:
            raise ValueError(f"metrics_interval_s must be > 0, got {self.metrics_interval_s}")
        _ = self.allow_list  # parse the patterns now, so a bad one fails at start-up
        return self

    @property
    def pool_processes(self) -> int:
        return self.processes or os.cpu_count() or 1

    @property
    def allow_list(self) -> AllowList:
        return AllowList(([*BUILTIN_REFS] if self.allow_builtins else []) + list(self.allow))

    @property
    def instance_name(self) -> str:
        return self.instance or f"{os.uname().nodename}-{os.getpid()}"
