"""What a model call costs, learnt from the decode steps: a fixed part per call and a part per row.

A decode step runs one token per row, so its time is close to `fixed + per_row * rows`. On CPU with a
small model the fixed part (the model's Python, one call) dominates; with a large model the rows do.
The backend asks `worth_merging` before prefilling newcomers inside the decode call, which saves one
call but makes every running row compute the newcomers' prompt length in (masked) positions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CallCost:
    decay: float = 0.98
    """Weight of the past per observation: the fit follows a machine whose load changes."""
    min_calls: int = 20
    """Decode calls observed (at two or more batch sizes) before the fit is trusted; until then no merging."""
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    _calls: int = 0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self._n, self._sx, self._sy = d * self._n + 1, d * self._sx + rows, d * self._sy + seconds
        self._sxx, self._sxy = d * self._sxx + rows * rows, d * self._sxy + rows * seconds
        self._calls += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds per call, seconds per row), or None while there is too little to go on."""
        var = self._n * self._sxx - self._sx * self._sx
        if self._calls < self.min_calls or var <= 1e-9 * max(1.0, self._n * self._sxx):
            return None
        per_row = max(0.0, (self._n * self._sxy - self._sx * self._sy) / var)
        fixed = (self._sy - per_row * self._sx) / self._n
        return fixed, per_row

    def worth_merging(self, padded_rows: int) -> bool:
        """Whether `padded_rows` extra row-positions cost less than the model call they save."""
        fit = self.fit()
        return fit is not None and fit[1] * padded_rows < fit[0]
