"""Rounding a packed row's length up to one of a few values per doubling (`TrainerSettings.pack_rounding`).

The kernels that run a model on a CPU in bf16 (oneDNN's) are built and cached per shape: with packed
rows whose length changes every step, a trainer builds new kernels each step and its memory grows with
the cache. Rounding the length up to a multiple of the largest power of two at most `rounding` x n
costs at most that fraction of padding and leaves about 1 / rounding lengths per doubling.
"""

from __future__ import annotations


def rounded(n: int, rounding: float) -> int:
    """`n` rounded up to a multiple of the largest power of two at most `rounding` x n; `n` itself when
    that is below 2 (`rounding` 0 included). For example with 0.125: 100 -> 104, 500 -> 512, 3000 -> 3072."""
    reach = int(n * rounding)
    if reach < 2:
        return n
    step = 1 << (reach.bit_length() - 1)
    return -(-n // step) * step
