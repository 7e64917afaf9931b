"""A real task for a real model: seeded arithmetic word problems with a verifiable numeric answer.

Each row is a question such as "What is 37 + 405? Give the final answer as a number at the end of your
reply." in one of a few templated phrasings, with 1-3 digit operands (+, - or x), and its `answer` (the
integer result). The reward is `services.reward.builtin:numeric_match` (the last number of the reply
equals the answer). `jetrl up dataset_path=task:arith` generates a training set and a disjoint eval set
in the run directory (`services/up/run.py`); `make_arith_rows` gives them to anyone else.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

_TAIL = "Give the final answer as a number at the end of your reply."
TEMPLATES: tuple[str, ...] = (
    "What is {a} {op} {b}? " + _TAIL,
    "Compute {a} {op} {b}. " + _TAIL,
    "Calculate the value of {a} {op} {b}. " + _TAIL,
    "Sam has {a} marbles. {story} How many marbles does Sam have now? " + _TAIL,
)
_STORY = {"+": "He finds {b} more.", "-": "He gives {b} away."}
_OPS = ("+", "-", "*")


def _operand(rng: random.Random) -> int:
    """1, 2 or 3 digits, each width equally likely."""
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def make_arith_row(rng: random.Random, index: int, ops: tuple[str, ...] = ("+",)) -> dict[str, Any]:
    op = rng.choice(ops)
    a, b = _operand(rng), _operand(rng)
    if op == "-" and b > a:  # non-negative answers: what the story template can tell
        a, b = b, a
    templates = TEMPLATES if op in _STORY else TEMPLATES[:3]
    template = rng.choice(templates)
    shown = "x" if op == "*" else op
    prompt = template.format(a=a, b=b, op=shown, story=_STORY.get(op, "").format(b=b))
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return {"id": f"arith-{index}", "prompt": prompt, "answer": str(answer)}


def make_arith_rows(n: int, seed: int = 0, ops: tuple[str, ...] = ("+",), exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """`n` rows drawn with `seed`; none whose prompt is in `exclude` (an eval set's)."""
    if n < 1:
        raise ValueError(f"make_arith_rows: n must be >= 1, got {n}")
    unknown = [op for op in ops if op not in _OPS]
    if unknown or not ops:
        raise ValueError(f"make_arith_rows: ops {list(ops)}: each must be one of {list(_OPS)}")
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        row = make_arith_row(rng, len(rows), ops)
        if exclude is None or row["prompt"] not in exclude:
            rows.append(row)
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


TASKS = ("arith",)
"""The generated tasks `jetrl up` knows (`dataset_path=task:<name>`)."""


def write_task(name: str, directory: Path, n: int, eval_n: int = 256) -> tuple[Path, Path]:
    """The task's training set (`n` rows, seed 0) and its eval set (`eval_n` rows, seed 1, no prompt
    shared with the training set), written under `directory`."""
    if name not in TASKS:
        raise ValueError(f"dataset_path task:{name}: unknown task (known: {', '.join(TASKS)})")
    held_out = make_arith_rows(eval_n, seed=1)
    train = make_arith_rows(n, seed=0, exclude={r["prompt"] for r in held_out})
    return write_rows(directory / f"{name}.jsonl", train), write_rows(directory / f"{name}-eval.jsonl", held_out)
