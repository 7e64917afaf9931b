"""The reference answer of a dataset row, as the built-in reward functions read it (in a module of its
own so that `builtin` and `builtin_math` share it without importing each other)."""

from __future__ import annotations

from typing import Any


def reference_answer(row: dict[str, Any], fn: str) -> str:
    for key in ("answer", "solution", "ground_truth"):
        if row.get(key) is not None:
            return str(row[key])
    raise ValueError(f"{fn}: the item has no 'answer' (or 'solution' / 'ground_truth') field to compare with")
