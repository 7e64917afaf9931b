"""The default demo task, copy3: prompt `<bos>123=`, answer `123`; the tiny model learns it from
chance (~0.02) to 0.9 in ~130 GRPO steps (docs/reference/tiny-model-rl.md)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


def make_copy3_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        rows.append({"id": f"copy3-{i}", "prompt": f"{digits}=", "answer": digits})
    return rows


def write_copy3_dataset(path: str | Path, n: int = 4096, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in make_copy3_rows(n, seed):
            f.write(json.dumps(row) + "\n")
    return path


def copy3_reward(completion: str, answer: str, **_: Any) -> float:
    """Fraction of the answer's positions the completion gets right."""
    if not answer:
        raise ValueError("copy3_reward: empty answer")
    return sum(1 for a, b in zip(completion, answer, strict=False) if a == b) / len(answer)
