"""`AsyncRewardWrapper`: a synchronous reward function awaited from a workflow, run in a process pool
(`pebble`), with AReaL's semantics (`areal.api.reward_api.AsyncRewardWrapper`):

- `timeout_seconds` (15) per attempt; a timed-out attempt is retried, and after the last one the
  reward is 0 (AReaL's choice, kept so a ported workflow trains the same; logged as a warning). Unlike
  AReaL's `ProcessPoolExecutor`, pebble ends the process of a timed-out call, so a reward that hangs
  does not keep a worker busy forever;
- an exception raised by the function is logged and retried; after the last attempt it propagates;
- a pool process that died (a crash in native code) is replaced and the call retried; after the last
  attempt the error propagates;
- `max_retries` (3) retries, so `max_retries + 1` attempts;
- pools are shared by `max_workers` (default: half the cores, at least 1) and stopped at exit.

The function and its arguments must be picklable, and the function importable by its module name
(math_verify's timeouts need the main thread of a process, one reason AReaL runs rewards this way).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from services.common.logging import get_logger

log = get_logger("rollout.reward")


class AsyncRewardWrapper:
    _pools: ClassVar[dict[int, Any]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()
    _atexit: ClassVar[bool] = False

    def __init__(self, reward_fn: Callable[..., Any], timeout_seconds: float = 15, max_workers: int | None = None,
                 max_retries: int = 3) -> None:
        if not callable(reward_fn):
            raise TypeError(f"AsyncRewardWrapper: reward_fn must be callable, got {type(reward_fn).__name__}")
        self.reward_fn = reward_fn
        self.timeout_seconds = timeout_seconds
        self.max_workers = max_workers or max((os.cpu_count() or 1) // 2, 1)
        self.max_retries = max_retries

    @classmethod
    def _pool(cls, max_workers: int) -> Any:
        """The shared pool of `max_workers` processes, made on first use (after the workflow's own
        modules are imported, so a forked process has them)."""
        from pebble import ProcessPool

        with cls._lock:
            pool = cls._pools.get(max_workers)
            if pool is None or not pool.active:
                pool = cls._pools[max_workers] = ProcessPool(max_workers=max_workers)
            if not cls._atexit:
                atexit.register(cls.shutdown)
                cls._atexit = True
            return pool

    @classmethod
    def shutdown(cls) -> None:
        """Stop every pool (at exit, or when a test is done with them)."""
        with cls._lock:
            for pool in cls._pools.values():
                pool.stop()
                pool.join(timeout=5)
            cls._pools.clear()

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        from pebble import ProcessExpired

        attempts = self.max_retries + 1
        for attempt in range(1, attempts + 1):
            last = attempt == attempts
            future = self._pool(self.max_workers).schedule(self.reward_fn, args=args, kwargs=kwargs,
                                                           timeout=self.timeout_seconds)
            try:
                return await asyncio.wrap_future(future)
            except TimeoutError:
                log.warning("reward timed out", reward_fn=_name(self.reward_fn), timeout_s=self.timeout_seconds,
                            attempt=attempt, of=attempts, then="reward 0" if last else "retry")
                if last:
                    return 0.0
            except ProcessExpired as exc:  # the pool replaces the dead process by itself
                log.warning("reward process died", reward_fn=_name(self.reward_fn), error=str(exc), attempt=attempt, of=attempts)
                if last:
                    raise
            except asyncio.CancelledError:
                future.cancel()
                raise
            except Exception as exc:
                log.warning("reward function raised", reward_fn=_name(self.reward_fn), error=repr(exc),
                            attempt=attempt, of=attempts, exc_info=exc)
                if last:
                    raise
        return 0.0  # not reached: the last attempt returns or raises


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
