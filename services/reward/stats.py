"""What the reward service measures between two metrics events: items/s, request latency
percentiles, and counts by outcome. Totals are monotonic; rates and percentiles cover the window."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

from schemas.messages import RewardResult


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no samples."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), math.ceil(q / 100.0 * len(ordered))))
    return ordered[rank - 1]


@dataclass
class RewardStats:
    totals: Counter[str] = field(default_factory=Counter)
    _window_items: int = 0
    _window_latencies: list[float] = field(default_factory=list)
    _window_start: float = field(default_factory=time.monotonic)

    def request_done(self, results: list[RewardResult], latency_s: float) -> None:
        self.totals["requests"] += 1
        self.totals["items"] += len(results)
        for r in results:
            self.totals[f"items_{r.status}"] += 1
        self._window_items += len(results)
        self._window_latencies.append(latency_s)

    def refused(self, reason: str) -> None:
        """A request answered with a request-level error: `malformed` or `refused` (not allowed, too big)."""
        self.totals[f"requests_{reason}"] += 1

    def snapshot(self, pool_restarts: int, pool_extra_started: int, pool_processes: int, in_flight: int) -> dict[str, float]:
        """The values of one metrics event; starts a new window."""
        now = time.monotonic()
        elapsed = max(now - self._window_start, 1e-9)
        lat = self._window_latencies
        values: dict[str, float] = {
            "items_per_s": self._window_items / elapsed,
            "requests_per_s": len(lat) / elapsed,
            "latency_p50_s": percentile(lat, 50),
            "latency_p99_s": percentile(lat, 99),
            "timeouts": float(self.totals["items_timeout"]),
            "errors": float(self.totals["items_error"]),
            "pool_restarts": float(pool_restarts),
            "pool_extra_started": float(pool_extra_started),
            "pool_processes": float(pool_processes),
            "in_flight_requests": float(in_flight),
            **{k: float(v) for k, v in self.totals.items()},
        }
        self._window_items = 0
        self._window_latencies = []
        self._window_start = now
        return values
