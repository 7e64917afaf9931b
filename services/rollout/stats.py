"""Rollout throughput figures, published on METRICS every `metrics_interval_s`.

Rates are over the last interval (what a dashboard plots); totals ride along as counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from schemas import metric_names as names


@dataclass
class RolloutStats:
    started: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    episodes: int = 0
    accepted: int = 0
    rejected: int = 0
    samples: int = 0
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    _mark: float = field(default_factory=time.monotonic)
    _mark_episodes: int = 0
    _mark_tokens: int = 0
    _mark_rejected: int = 0

    def episode_done(self, latency_s: float, samples: int, tokens: int, rejected: bool) -> None:
        self.episodes += 1
        self.latencies.append(latency_s)
        if rejected:
            self.rejected += 1
        else:
            self.accepted += 1
            self.samples += samples
            self.tokens += tokens

    def snapshot(self) -> dict[str, float]:
        """The figures of the interval since the last snapshot; resets the interval."""
        now = time.monotonic()
        dt = max(now - self._mark, 1e-9)
        episodes = self.episodes - self._mark_episodes
        rejected = self.rejected - self._mark_rejected
        lat = sorted(self.latencies)
        values = {
            "episodes_per_s": episodes / dt,
            "tokens_per_s": (self.tokens - self._mark_tokens) / dt,
            "rejection_rate": rejected / episodes if episodes else 0.0,
            "in_flight": float(self.in_flight),
            "episodes_total": float(self.episodes),
            "accepted_total": float(self.accepted),
            "rejected_total": float(self.rejected),
            "samples_total": float(self.samples),
            "tokens_total": float(self.tokens),
        }
        if lat:
            values["episode_latency_s_mean"] = sum(lat) / len(lat)
            values["episode_latency_s_p50"] = lat[len(lat) // 2]
            values["episode_latency_s_max"] = lat[-1]
        self._mark, self._mark_episodes, self._mark_tokens, self._mark_rejected = now, self.episodes, self.tokens, self.rejected
        self.latencies = []
        return values


def constraint_counters(engine: Any, workflow: Any) -> dict[str, float]:
    """Structured output's losses, totals since the start: generations the engine restarted after an
    abort cut them, agent replies that missed their constraint (the count of the agent proxy of the
    workflow, found through the worker's wrappers: `CheckedWorkflow`, `GroupedRolloutWorkflow`)."""
    proxy = None
    for _ in range(8):
        proxy = getattr(workflow, "proxy", None)
        if proxy is not None or workflow is None:
            break
        workflow = getattr(workflow, "workflow", None)
    unmet = getattr(getattr(proxy, "stats", None), "unmet", 0)
    return {names.CONSTRAINED_RESTARTS_TOTAL: float(getattr(engine, "constrained_restarts", 0)),
            names.CONSTRAINT_UNMET_TOTAL: float(unmet)}
