"""What runs inside a pool process: resolve a reward function once, call it on one item, and turn
whatever happens into ("ok", value) or ("error", message). Exceptions never leave this module, so
any exception the pool reports comes from the pool itself (a timeout, a dead process)."""

from __future__ import annotations

import importlib
import math
import numbers
import os
import traceback
from collections.abc import Callable
from typing import Any

_cache: dict[str, Callable[..., Any]] = {}

Outcome = tuple[str, float | str]


def initialize(modules: list[str]) -> None:
    """Pool initializer: import what the allowed functions need. It must never raise: pebble treats a
    process that dies in its initializer as a broken pool. An import that fails here fails again,
    with its message, when a request names the function."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException:  # broad on purpose: reported per request instead (see docstring)
            pass


def resolve(ref: str) -> Callable[..., Any]:
    fn = _cache.get(ref)
    if fn is not None:
        return fn
    module_name, _, func_name = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise LookupError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, func_name, None)
    if fn is None:
        raise LookupError(f"module {module_name!r} has no attribute {func_name!r}")
    if not callable(fn):
        raise LookupError(f"{ref} is a {type(fn).__name__}, not a function")
    _cache[ref] = fn
    return fn


def ping() -> int:
    return os.getpid()


def check(ref: str) -> str:
    """'' if `ref` resolves to a callable in a pool process, else why not."""
    try:
        resolve(ref)
    except LookupError as exc:
        return str(exc)
    return ""


def score(ref: str, kwargs: dict[str, Any]) -> Outcome:
    try:
        value = resolve(ref)(**kwargs)
    except Exception as exc:
        return "error", f"{ref} raised {_describe(exc)}"
    return to_outcome(ref, value)


def to_outcome(ref: str, value: Any) -> Outcome:
    """A reward must be a finite real number (bools and numpy scalars count); anything else is an
    error, never a silent 0."""
    if not isinstance(value, numbers.Real):
        return "error", f"{ref} returned {type(value).__name__} {value!r:.80}, expected a float"
    value = float(value)
    if not math.isfinite(value):
        return "error", f"{ref} returned {value}, expected a finite float"
    return "ok", value


def _describe(exc: BaseException) -> str:
    """The error and where it happened in the reward code (the last frame), without the whole trace."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"
