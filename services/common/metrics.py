"""Metrics are messages on the METRICS stream: `MetricsEvent` on `jetrl.<run>.metrics.<service>`.

Published with core NATS (fire and forget; the stream records them), so a service never blocks on
its metrics.
"""

from __future__ import annotations

import time
from collections import Counter

from nats.aio.client import Client as NATS

from schemas.messages import MetricsEvent, encode
from schemas.subjects import Subjects
from services.common.health import mirror_metrics
from services.common.logging import get_logger

log = get_logger("metrics")


class MetricsPublisher:
    def __init__(self, nc: NATS, run: str, service: str, worker: str = "") -> None:
        self.nc = nc
        self.run = run
        self.service = service
        self.worker = worker
        self.subject = Subjects(run).metrics(service)
        self.counters: Counter[str] = Counter()
        """Monotonic counts (malformed messages, timeouts, ...) included in every event."""

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    async def emit(self, values: dict[str, float], *, step: int | None = None, version: int | None = None) -> None:
        merged = {**{k: float(v) for k, v in self.counters.items()}, **{k: float(v) for k, v in values.items()}}
        event = MetricsEvent(
            run=self.run, service=self.service, worker=self.worker, step=step, version=version, time=time.time(), values=merged
        )
        mirror_metrics(self.service, self.worker, merged)  # Prometheus gauges on the side port's /metrics
        try:
            await self.nc.publish(self.subject, encode(event))
        except Exception as exc:  # metrics must never take a service down
            log.warning("metrics publish failed", error=repr(exc))
