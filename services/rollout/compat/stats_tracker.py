"""`stats_tracker`: a workflow's own statistics, as AReaL's workflows record them
(`stats_tracker.get(workflow_context.stat_scope()).scalar(reward=r, num_turns=t)`), reaching the
METRICS stream: the rollout worker exports what was recorded with every metrics event (the means over
the interval, under `<scope>/<key>`, e.g. `rollout/reward`), so they show in `jetrl up`'s
metrics.json (`workflow_stats`), `jetrl track` and `jetrl plot`.

Scopes (`with stats_tracker.scope("x")`) follow the running task (a context variable), so concurrent
episodes cannot push into each other's scope (AReaL keeps one stack per tracker). Reductions:
`scalar` values are averaged; `stat(denominator=mask_key, **tensors)` records the masked mean, min
and max (`key/avg`, `key/min`, `key/max`); `record_timing(key)` averages seconds under `timeperf/`.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from enum import Enum, auto
from typing import Any


class ReduceType(Enum):
    AVG_MIN_MAX = auto()
    AVG = auto()
    SUM = auto()
    MIN = auto()
    MAX = auto()
    SCALAR = auto()


_SCOPES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("jetrl_stats_scopes", default=())


class StatsTracker:
    def __init__(self, name: str = "") -> None:
        self.name = name.strip("/")
        self._lock = threading.Lock()
        self._scalars: dict[str, list[float]] = defaultdict(list)
        self._masks: dict[str, list[Any]] = defaultdict(list)
        self._stats: dict[str, list[tuple[Any, str, ReduceType]]] = defaultdict(list)

    def _key(self, key: str) -> str:
        return "/".join([*([self.name] if self.name else []), *_SCOPES.get(), key])

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        token = _SCOPES.set((*_SCOPES.get(), name.strip("/")))
        try:
            yield
        finally:
            _SCOPES.reset(token)

    def scope_func_wrapper(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                with self.scope(name):
                    return func(*args, **kwargs)

            return wrapper

        return decorator

    def scalar(self, **values: Any) -> None:
        with self._lock:
            for key, value in values.items():
                self._scalars[self._key(key)].append(float(value))

    @contextlib.contextmanager
    def record_timing(self, key: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._scalars[f"timeperf/{key}"].append(time.perf_counter() - start)

    def denominator(self, **masks: Any) -> None:
        with self._lock:
            for key, mask in masks.items():
                if getattr(mask, "dtype", None) is None or "bool" not in str(mask.dtype):
                    raise ValueError(f"stats_tracker.denominator: {key} must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
                self._masks[self._key(key)].append(mask.detach().clone() if hasattr(mask, "detach") else mask.copy())

    def stat(self, denominator: str, reduce_type: ReduceType | None = None, **values: Any) -> None:
        with self._lock:
            mask_key = self._key(denominator)
            if not self._masks.get(mask_key):
                raise ValueError(f"stats_tracker.stat: denominator {mask_key!r} was not recorded")
            for key, value in values.items():
                if reduce_type is ReduceType.SCALAR:
                    raise ValueError("stats_tracker.stat: the scalar reduce type is for scalar(), not a tensor")
                mask = self._masks[mask_key][-1]
                if tuple(mask.shape) != tuple(value.shape):
                    raise ValueError(f"stats_tracker.stat: {key} has shape {tuple(value.shape)}, its denominator {tuple(mask.shape)}")
                self._stats[self._key(key)].append((value.detach().float().clone(), mask_key, reduce_type or ReduceType.AVG_MIN_MAX))

    def export(self, key: str | None = None, reduce_group: Any = None, reset: bool = True) -> dict[str, float]:
        """The recorded values reduced, by full key; `reset` empties the tracker."""
        with self._lock:
            out = {k: sum(v) / len(v) for k, v in self._scalars.items() if v and (key is None or k == key)}
            for k, entries in self._stats.items():
                if key is not None and k != key:
                    continue
                picked = [value[mask_of.bool()] for value, mask_key, _ in entries
                          for mask_of in [self._masks[mask_key][-1]]]
                import torch

                flat = torch.cat([p.flatten() for p in picked]) if picked else torch.empty(0)
                if flat.numel() == 0:
                    continue
                kind = entries[-1][2]
                if kind in (ReduceType.AVG_MIN_MAX, ReduceType.AVG):
                    out[f"{k}/avg" if kind is ReduceType.AVG_MIN_MAX else k] = float(flat.mean())
                if kind is ReduceType.AVG_MIN_MAX:
                    out[f"{k}/min"], out[f"{k}/max"] = float(flat.min()), float(flat.max())
                elif kind is ReduceType.SUM:
                    out[k] = float(flat.sum())
                elif kind is ReduceType.MIN:
                    out[k] = float(flat.min())
                elif kind is ReduceType.MAX:
                    out[k] = float(flat.max())
            for k, masks in self._masks.items():
                if key is None or k == key:
                    out[k] = float(sum(float(m.sum()) for m in masks))
            if reset:
                self._scalars.clear()
                self._stats.clear()
                self._masks.clear()
            return out


DEFAULT_TRACKER = StatsTracker()
TRACKERS: dict[str, StatsTracker] = {"": DEFAULT_TRACKER}
_LOCK = threading.Lock()

stat = DEFAULT_TRACKER.stat
denominator = DEFAULT_TRACKER.denominator
export = DEFAULT_TRACKER.export
scope = DEFAULT_TRACKER.scope
scalar = DEFAULT_TRACKER.scalar
record_timing = DEFAULT_TRACKER.record_timing
scope_func_wrapper = DEFAULT_TRACKER.scope_func_wrapper


def get(name: str = "") -> StatsTracker:
    """The tracker whose keys start with `name` (a workflow passes `workflow_context.stat_scope()`)."""
    with _LOCK:
        if name not in TRACKERS:
            TRACKERS[name] = StatsTracker(name)
        return TRACKERS[name]


def export_all(reduce_group: Any = None, reset: bool = True) -> dict[str, float]:
    """Every tracker's values, by full key (what the rollout worker puts on METRICS)."""
    out: dict[str, float] = {}
    for tracker in list(TRACKERS.values()):
        out.update(tracker.export(reset=reset))
    return out
