"""What runs inside a pool process: resolve a reward function once, call it on each item of a batch by
its signature, and turn whatever happens into ("ok", value) or ("error", message). Nothing the
function raises leaves this module, not even SystemExit or KeyboardInterrupt: `sys.exit(0)` in reward
code is that item's error, never the end of the process (let alone, re-raised by a pool, of the
service). After each item, the processes the function started are killed (see `proctree`).

Before each item the process writes into `shared[0]` (an array it shares with the service) which item
of the batch it starts and when, so the service can time out that item and blame that item alone;
it stops before the item at `shared[1]` (the service lowers it to take back the items behind a slow
one). Only the standard library and our own light modules are imported here: the fork server loads
this module, and everything it imports is paid for by the service's start."""

from __future__ import annotations

import importlib
import math
import multiprocessing
import numbers
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from services.common.refs import RefError, resolve_ref
from services.reward import proctree
from services.reward.calling import Caller, CallError, caller

_cache: dict[str, Caller] = {}

Outcome = tuple[str, float | str]

_POSITION_BITS = 20
"""`shared[0]` packs the item's position (low bits) and its start in ms of the monotonic clock (the
same clock in every process), so that one 8-byte write publishes both at once."""


def mark(position: int, now: float | None = None) -> int:
    started_ms = math.ceil((time.monotonic() if now is None else now) * 1000)  # rounded up: never early
    return started_ms << _POSITION_BITS | position


def unmark(value: int) -> tuple[int, float]:
    """(position, started) from `mark`."""
    return value & ((1 << _POSITION_BITS) - 1), (value >> _POSITION_BITS) / 1000


MAX_BATCH = (1 << _POSITION_BITS) - 1
"""Most items in one batch: the positions `mark` can hold."""


def serve(conn: Connection, modules: list[str], shared: Any) -> None:
    """A pool process's life: its own process group, the imports, ("ready", pid), then one reply per
    request until the service closes the pipe (or dies: the pipe closes with it)."""
    proctree.become_group_leader_and_subreaper()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the service, which stops us
    threading.Thread(target=_die_with_the_service, name="lifeline", daemon=True).start()
    initialize(modules)
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    while True:
        try:
            op, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        conn.send_bytes(pickle.dumps(handle(op, args, shared), pickle.HIGHEST_PROTOCOL))


def _die_with_the_service() -> None:
    """If the service dies (even SIGKILL), end this process and what it started: a function stuck
    in reward code never reads the pipe again, so its EOF alone would not stop us."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return
    wait([parent.sentinel])
    proctree.kill_descendants_and_self()


def handle(op: str, args: tuple[Any, ...], shared: Any) -> Any:
    if op == "score":
        ref, items = args
        return score_batch(ref, items, shared)
    if op == "check":
        return check(*args)
    return ping()


def initialize(modules: list[str]) -> None:
    """Import what the allowed functions need. It never raises: an import that fails here fails
    again, with its message, when a request names the function."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException:  # broad on purpose: reported per request instead (see docstring)
            pass


def resolve(ref: str) -> Caller:
    found = _cache.get(ref)
    if found is not None:
        return found
    try:
        fn = resolve_ref(ref)
    except RefError as exc:
        raise LookupError(str(exc)) from exc
    if not callable(fn):
        raise LookupError(f"{ref} is a {type(fn).__name__}, not a function")
    found = _cache[ref] = caller(fn)
    return found


def ping() -> int:
    return os.getpid()


def check(ref: str) -> str:
    """'' if `ref` resolves to a callable in a pool process, else why not."""
    try:
        resolve(ref)
    except LookupError as exc:
        return str(exc)
    except BaseException as exc:  # e.g. a module-level __getattr__ that raises
        return f"cannot load {ref}: {_describe(exc)}"
    return ""


def score_batch(ref: str, items: Sequence[dict[str, Any]], shared: Any) -> tuple[list[Outcome], float]:
    """The outcomes of the items in order, up to `shared[1]` of them, and the seconds they took."""
    t0 = time.perf_counter()
    out: list[Outcome] = []
    for position, kwargs in enumerate(items):
        if position >= shared[1]:  # taken back by the service: scored elsewhere
            break
        shared[0] = mark(position)
        out.append(score(ref, kwargs))
    return out, time.perf_counter() - t0


def score(ref: str, kwargs: dict[str, Any]) -> Outcome:
    try:
        return to_outcome(ref, resolve(ref)(kwargs))
    except CallError as exc:
        return "error", f"{ref} cannot be called with this item: {exc}"
    except BaseException as exc:  # SystemExit, KeyboardInterrupt, anything: this item's error only
        return "error", f"{ref} raised {_describe(exc)}"
    finally:
        proctree.reap_children()


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
    try:
        text = str(exc)
    except BaseException:  # an exception whose __str__ raises must not escape either
        text = "(its message could not be read)"
    return f"{type(exc).__name__}: {text}{where}"
