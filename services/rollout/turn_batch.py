"""What the rollout's per-turn batchers share (`batching.py` for `/generate`, `reward_batching.py` for
rewards): a batch's send runs as a task held until it ends and cancelled once every caller waiting on it
is gone, and a failure reaches every caller still waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any


def send_batch(tasks: set[asyncio.Task[None]], send: Coroutine[Any, Any, None], futures: Sequence[asyncio.Future[Any]]) -> None:
    """Run `send` as a task kept in `tasks` (a bare task may be collected) until it ends; cancel it once
    every one of `futures` (its callers' answers) is cancelled."""
    task = asyncio.get_running_loop().create_task(send)
    tasks.add(task)
    task.add_done_callback(tasks.discard)

    def cancel_when_unwanted(_: asyncio.Future[Any]) -> None:
        if all(f.cancelled() for f in futures):
            task.cancel()

    for future in futures:
        future.add_done_callback(cancel_when_unwanted)


def fail(futures: Sequence[asyncio.Future[Any]], exc: BaseException) -> None:
    """Every caller still waiting gets `exc`."""
    for future in futures:
        if not future.done():
            future.set_exception(exc)
