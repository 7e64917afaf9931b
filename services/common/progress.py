"""Progress of long work (export, import, replay, model builds) as log lines at most every few
seconds: what is done, of how much when known, the rate and the time left. Log lines rather than a
bar, so the same progress reads in a terminal, in a container's log and in `jetrl up`'s log files."""

from __future__ import annotations

import math
import time
from typing import Any

from services.common.logging import get_logger


class Progress:
    def __init__(self, what: str, unit: str, total: float | None = None, every_s: float = 3.0, **context: Any) -> None:
        self.log = get_logger(what)
        self.what, self.unit, self.every_s, self.context = what, unit, every_s, context
        self.total = total if total is not None and math.isfinite(total) and total > 0 else None
        self.done = 0.0
        self.started = self._last = time.monotonic()

    def advance(self, n: float = 1, **fields: Any) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self.log.info("progress", **self.figures(now), **self.context, **fields)

    def figures(self, now: float | None = None) -> dict[str, Any]:
        elapsed = max((now or time.monotonic()) - self.started, 1e-9)
        rate = self.done / elapsed
        out: dict[str, Any] = {self.unit: int(self.done), f"{self.unit}_per_s": round(rate, 1), "elapsed_s": round(elapsed, 1)}
        if self.total is not None:
            out["of"] = int(self.total)
            out["percent"] = round(100.0 * min(self.done / self.total, 1.0), 1)
            if rate > 0:
                out["eta_s"] = round(max(self.total - self.done, 0.0) / rate, 1)
        return out

    def finish(self, **fields: Any) -> dict[str, Any]:
        figures = self.figures()
        self.log.info("done", **figures, **self.context, **fields)
        return figures
