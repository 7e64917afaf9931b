"""Processes a reward function leaves behind. Each pool process leads its own process group and is a
child subreaper, so whatever a function starts either stays in the group or, orphaned, comes back to
the pool process as a child; `reap_children` (in the pool process, after every item) and `kill_tree`
(in the service, when a pool process is killed or dies) end them. Linux only, read from /proc: the
service runs in Linux containers and needs no extra dependency for it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36


def become_group_leader_and_subreaper() -> None:
    """In a new pool process: its own process group (killed as one), and orphans of its descendants
    re-parented to it rather than to init, so they stay findable."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
        found[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first), read now."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def alive(pid: int) -> bool:
    """`pid` runs (it exists and is not a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def kill_tree(pid: int) -> int:
    """SIGKILL a pool process, its process group and every descendant (one that left the group, e.g.
    with setsid, is found through its parents while they live). Returns how many processes it hit
    besides `pid`."""
    below = descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # the group outlives its leader: orphans still in it are hit too
    _kill(pid)
    for p in below:
        _kill(p)
    return len(below)


def kill_descendants_and_self() -> None:
    """A pool process's last act when the service is gone."""
    me = os.getpid()
    for p in descendants(me):
        _kill(p)
    if os.getpgrp() == me:  # only our own group: otherwise it would be the service's, and its caller's
        with contextlib.suppress(OSError):
            os.killpg(me, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


def reap_children() -> int:
    """In a pool process after an item: kill what the function started and left running, and reap
    it. Cheap when it started nothing: one waitpid says there are no children at all (as subreaper,
    any descendant left is a child or below one)."""
    killed = rounds = 0
    while rounds < 10:  # a function's child may fork while we kill: a few rounds catch its offspring
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return killed
        if pid:
            continue  # reaped one that had exited already; look again
        rounds += 1
        below = descendants(os.getpid())
        for p in below:
            _kill(p)
        killed += len(below)
        for p in below:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(p, 0)  # only our children can be waited; the rest come back to us as orphans
    return killed
