"""Reward functions that misbehave on purpose, for the reward service's tests. The service imports
them in its pool processes (allow-listed as `tests.reward_fns:*`); the repo root must be importable."""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any


def length(completion: str = "", **_: Any) -> float:
    """A well-behaved reward: the completion's length."""
    return float(len(completion))


def sleepy(completion: str = "", sleep_s: float = 0.0, **_: Any) -> float:
    """Sleeps `sleep_s` (a row field), then scores like `length`."""
    time.sleep(float(sleep_s))
    return float(len(completion))


def exit_now(**_: Any) -> float:
    os._exit(7)


def segfault(**_: Any) -> float:
    ctypes.string_at(0)  # reads address 0: SIGSEGV
    return 0.0


def raises(**_: Any) -> float:
    raise KeyError("no such field in this row")


def returns_text(**_: Any) -> Any:
    return "1.0"


def pid(**_: Any) -> float:
    """The scoring process's pid: tells which pool process ran an item."""
    return float(os.getpid())
