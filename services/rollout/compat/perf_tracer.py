"""AReaL's perf tracer (`areal.utils.perf_tracer`) as its workflows use it: decorators and context
managers that mark phases of a session. jetrl records episode latencies itself (METRICS
`episode_latency_s_*`) and keeps no per-phase trace: these accept the same arguments and only run
what they wrap."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any


def trace_session(phase: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        return func

    return decorator


def session_context(*_: Any, **__: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            return await func(*args, **kwargs)

        return wrapper

    return decorator


@contextlib.asynccontextmanager
async def atrace_session_phase(phase: str, **_: Any) -> AsyncIterator[None]:
    yield


@contextlib.contextmanager
def trace_session_phase(phase: str, **_: Any) -> Iterator[None]:
    yield


def trace_perf(name: str, **_: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        return func

    return decorator
