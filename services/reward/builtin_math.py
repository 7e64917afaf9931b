"""The built-in `services.reward.builtin:math_verify`, in a module of its own so that math-verify is
imported only where it is used: a pool process imports it when it resolves the function, before its
first item (outside any item's timeout)."""

from __future__ import annotations

from typing import Any

import math_verify as _mv

from services.reward.answers import reference_answer


def math_verify(completion: str = "", **row: Any) -> float:
    """1.0 if math-verify finds the completion's final answer equivalent to the reference (LaTeX,
    fractions, boxed answers, numbers), else 0.0. A GSM8K answer field (worked solution, then
    `#### <answer>`) is read as what follows its `####`."""
    answer = reference_answer(row, "math_verify")
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip()
    gold = _mv.parse(answer)
    if not gold:
        gold = _mv.parse(f"${answer}$")
    if not gold:
        raise ValueError(f"math_verify: math-verify cannot parse the reference answer {answer!r}")
    pred = _mv.parse(completion)
    if not pred:
        return 0.0
    return 1.0 if _mv.verify(gold, pred) else 0.0
