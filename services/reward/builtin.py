"""Built-in reward functions, allow-listed by default (math_verify's code is in `builtin_math`). Each is called as
`fn(prompt=..., completion=..., prompt_ids=..., completion_ids=..., **row)` and returns a float.

A completion that is merely wrong scores 0.0; a dataset row that cannot be scored (no answer, an
answer that is not a number for `numeric_match`) raises, so the item comes back as `error` instead
of a 0 that would look like a wrong answer.
"""

from __future__ import annotations

import math
import re
from typing import Any

from services.common.demo_task import copy3_reward
from services.reward.answers import reference_answer

_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")


def copy3(completion: str = "", **row: Any) -> float:
    """The default demo task: the fraction of the answer's positions the completion gets right."""
    return copy3_reward(completion, reference_answer(row, "copy3"))


def exact_match(completion: str = "", **row: Any) -> float:
    """1.0 if the completion equals the answer after trimming surrounding whitespace, else 0.0."""
    return 1.0 if completion.strip() == reference_answer(row, "exact_match").strip() else 0.0


def parse_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators allowed), or None."""
    found = _NUMBER_RE.findall(text)
    if not found:
        return None
    return float(found[-1].replace(",", ""))


def numeric_match(completion: str = "", rel_tol: float = 1e-6, abs_tol: float = 1e-9, **row: Any) -> float:
    """1.0 if the last number in the completion equals the answer (within `rel_tol`/`abs_tol`, which a
    dataset row may set), else 0.0."""
    answer = reference_answer(row, "numeric_match")
    gold = parse_number(answer)
    if gold is None:
        raise ValueError(f"numeric_match: the answer {answer!r} is not a number")
    got = parse_number(completion)
    if got is None:
        return 0.0
    return 1.0 if math.isclose(got, gold, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


def __getattr__(name: str) -> Any:
    """`math_verify` lives in `builtin_math` and is imported on first use: math-verify costs ~0.5 CPU-s
    to import, which the users of the other built-ins (and the fork server) need not pay."""
    if name == "math_verify":
        from services.reward.builtin_math import math_verify

        return math_verify
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
