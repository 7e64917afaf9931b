"""Reward functions that misbehave on purpose, for the reward service's tests. The service imports
them in its pool processes (allow-listed as `tests.reward_fns:*`); the repo root must be importable."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
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


def exits_if(completion: str = "", crash: bool = False, **_: Any) -> float:
    """Ends its process (exit code 7) for an item whose row says `crash`; else scores like `length`."""
    if crash:
        os._exit(7)
    return float(len(completion))


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


def exits_zero(**_: Any) -> float:
    """`sys.exit(0)`: a SystemExit that must not reach the service."""
    sys.exit(0)


def exits_hard_zero(**_: Any) -> float:
    """`os._exit(0)`: the process ends "successfully" in the middle of an item."""
    os._exit(0)


def interrupts(**_: Any) -> float:
    raise KeyboardInterrupt


def raises_base(**_: Any) -> float:
    raise ShoutError("not an Exception")


class ShoutError(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


def spawns(pid_file: str = "", hang_s: float = 0.0, **_: Any) -> float:
    """Starts two `sleep` children (one in its own session, as a daemon would), writes its own pid and
    theirs to `pid_file`, then sleeps `hang_s` (a row field). Either way, the children must not
    outlive the item."""
    children = [subprocess.Popen(["sleep", "600"]), subprocess.Popen(["sleep", "600"], start_new_session=True)]
    with open(pid_file + ".tmp", "w") as f:
        f.write(" ".join(str(p) for p in (os.getpid(), *(c.pid for c in children))))
    os.rename(pid_file + ".tmp", pid_file)  # a reader sees all three pids or no file
    time.sleep(float(hang_s))
    return 1.0


def areal_style(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    """The signature AReaL's workflows call: `completions` (one completion's text, plural in name)."""
    return float(len(completions) + len(completion_ids) + int(data["bonus"]))


def only_what_it_needs(completion: str, answer: str) -> float:
    """No **kwargs: gets only the fields it names."""
    return 1.0 if completion == answer else 0.0
