"""What every service's process does before it runs, however `jetrl up` starts it (`python -m` by
`Stack`, or forked by the fork server): a session of its own (so its process group can be signalled
whole), SIGTERM when its parent dies, and its niceness and cores."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """New session and process group, and SIGTERM when the parent (`jetrl up`, or the fork server) dies."""
    os.setsid()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def child_setup(nice: int, cpus: tuple[int, ...] = ()) -> Callable[[], None]:
    """`die_with_parent`, then `os.nice(nice)` and `os.sched_setaffinity(cpus)` when asked: a `Popen`'s
    `preexec_fn`, or called by a forked service."""
    def setup() -> None:
        die_with_parent()
        if nice:
            os.nice(nice)
        if cpus:
            with contextlib.suppress(OSError):  # pinning only speeds a start up: a process runs unpinned rather than not at all
                os.sched_setaffinity(0, cpus)  # (the trainer and the servers log the cores they got)

    return setup
