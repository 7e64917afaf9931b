"""One pool process as the service sees it: started from the fork server, given one batch of items at
a time over its own pipe, and killed with everything it started when an item runs past its time or
the process is given up.

A batch is one message each way, so a request's items cost one write and one wake-up, not one per
item. Per-item timeouts still hold: the process writes into a small shared array which item it is
on and since when (`progress`), and the service reads it when its timer fires; the items after the
one running can be taken back (`limit`) when that item turns slow. The event loop watches the pipe
and the process's exit sentinel for the process's whole life (no thread, no per-call registration).
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import pickle
import threading
import time
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

from services.reward import proctree, worker

_STARTING = threading.Lock()
_DIED = object()
_SLACK_S = 0.001
"""Timers may fire this much early (the loop's clock resolution); a deadline that close counts as reached."""


class ProcessDied(RuntimeError):
    """The pool process ended while it had a request: `exitcode` as multiprocessing reports it,
    `position` the item of the batch it was running."""

    def __init__(self, exitcode: int | None, position: int = 0) -> None:
        self.exitcode = exitcode
        self.position = position
        how = f"signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
        super().__init__(f"the scoring process died ({how})")


class ItemTimeout(TimeoutError):
    """The item at `position` of the batch ran past its timeout."""

    def __init__(self, position: int, timeout_s: float) -> None:
        self.position = position
        super().__init__(f"no reply within {timeout_s:g} s")


class PoolProcess:
    def __init__(self, ctx: BaseContext, preload: list[str], on_lost: Callable[[PoolProcess], None] | None = None) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self._child = child
        # [progress, limit]: written by the process before each item, read by the service (see worker)
        self.shared = ctx.RawArray(ctypes.c_int64, 2)
        # not daemonic: a reward function may start processes of its own (multiprocessing refuses
        # that in a daemon); the service kills pool processes itself, and one whose service died
        # kills itself (the worker's lifeline thread)
        self.proc = ctx.Process(target=worker.serve, args=(child, preload, self.shared), name="jetrl-reward-pool")  # type: ignore[attr-defined]
        self.tasks = 0
        """Items answered, for `max_tasks_per_process`."""
        self.resolved: set[str] = set()
        """Functions it has resolved (imported) already, outside any item's timeout."""
        self.busy = False
        self.dead = False
        """It ended (seen by the reader); `on_lost` is told at once if that happened while idle."""
        self._on_lost = on_lost
        self._waiter: asyncio.Future[Any] | None = None
        self._watched: tuple[int, ...] = ()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    @property
    def busy_since(self) -> float | None:
        """monotonic time the item it runs now started; None while idle."""
        return worker.unmark(self.shared[0])[1] if self.busy else None

    async def start(self, timeout_s: float) -> None:
        """Start it and wait for its "ready" (it has imported the allowed modules)."""
        await asyncio.to_thread(self._start)  # talks to the fork server: not in the event loop
        self._child.close()
        loop = self._loop = asyncio.get_running_loop()
        # the sentinel too: a child the function forked may hold the pipe open after the process died
        self._watched = (self.conn.fileno(), self.proc.sentinel)
        for fd in self._watched:
            loop.add_reader(fd, self._on_readable)
        reply = await self._wait(timeout_s)
        if reply is _DIED:
            raise ProcessDied(await self.exitcode())
        if not (isinstance(reply, tuple) and reply[:1] == ("ready",)):
            raise RuntimeError(f"a new scoring process sent {reply!r:.80} instead of ready")

    def _start(self) -> None:
        with _STARTING:  # multiprocessing's bookkeeping of started processes is not thread-safe
            self.proc.start()

    async def call(
        self,
        op: str,
        args: tuple[Any, ...],
        timeout_s: float,
        *,
        items: int = 1,
        slow_s: float = math.inf,
        on_slow: Callable[[int], None] | None = None,
    ) -> Any:
        """Send one request of `items` items and wait for its reply. An item past `timeout_s` raises
        `ItemTimeout`; the process ending first raises `ProcessDied`; either way the caller must
        `kill` it: it is not reused. When the running item has run `slow_s` and items are left
        behind it, they are taken back (the process stops before them) and `on_slow(first)` is
        called with the position of the first of them, once."""
        if self.dead:
            raise ProcessDied(await self.exitcode())
        self.shared[1] = items
        self.shared[0] = worker.mark(0)
        self.busy = True
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal timer, on_slow
            position, started = worker.unmark(self.shared[0])
            now = time.monotonic() + _SLACK_S
            if now >= started + timeout_s:
                if self._waiter is not None and not self._waiter.done():
                    self._waiter.set_exception(ItemTimeout(position, timeout_s))
                return
            wake_at = started + timeout_s
            if on_slow is not None and position + 1 < self.shared[1]:
                if now >= started + slow_s:
                    self.shared[1] = position + 1
                    callback, on_slow = on_slow, None
                    callback(position + 1)
                else:
                    wake_at = min(wake_at, started + slow_s)
            timer = loop.call_at(wake_at, check)

        try:
            try:
                self.conn.send_bytes(pickle.dumps((op, args), pickle.HIGHEST_PROTOCOL))
            except OSError:  # it died while idle: its pipe is closed
                raise ProcessDied(await self.exitcode()) from None
            timer = loop.call_at(loop.time() + min(timeout_s, slow_s), check)
            reply = await self._wait(None)
            if reply is _DIED:
                raise ProcessDied(await self.exitcode(), worker.unmark(self.shared[0])[0])
            return reply
        finally:
            self.busy = False
            if timer is not None:
                timer.cancel()

    @property
    def limit(self) -> int:
        """Items of the current batch still its own (fewer than sent once some were taken back)."""
        return int(self.shared[1])

    async def _wait(self, timeout_s: float | None) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiter = fut
        try:
            return await (fut if timeout_s is None else asyncio.wait_for(fut, timeout_s))
        finally:
            self._waiter = None

    def _on_readable(self) -> None:
        """The pipe has a reply, or the process ended (EOF, or its sentinel)."""
        try:
            if self.conn.poll():
                reply = pickle.loads(self.conn.recv_bytes())
                if self._waiter is not None and not self._waiter.done():
                    self._waiter.set_result(reply)
                return
        except (EOFError, OSError):
            pass
        else:
            # Only the sentinel woke us. A fork server's child's sentinel is a pipe from the fork
            # server, which also closes when the fork server dies (SIGTERM to the service's process
            # group) while the process lives on: then watch its pipe alone.
            if self.proc.pid is not None and proctree.alive(self.proc.pid) and self._loop is not None:
                self._loop.remove_reader(self.proc.sentinel)
                self._watched = self._watched[:1]
                return
        self._unwatch()
        self.dead = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(_DIED)
        elif self._waiter is None and self._on_lost is not None:
            self._on_lost(self)  # killed from outside while idle (the OOM killer): replace it now

    def _unwatch(self) -> None:
        if self._watched and self._loop is not None and not self._loop.is_closed():
            for fd in self._watched:
                self._loop.remove_reader(fd)
        self._watched = ()

    async def exitcode(self) -> int | None:
        await asyncio.to_thread(self.proc.join, 5.0)
        return self.proc.exitcode

    def kill(self) -> int:
        """SIGKILL it, its process group and its descendants; returns how many of those it had."""
        self._unwatch()
        self.conn.close()
        self._child.close()  # already closed once started; not if it never started
        if self.proc.pid is None:
            return 0
        killed = proctree.kill_tree(self.proc.pid)
        self.proc.join(1.0)  # SIGKILLed: its exit is immediate, this only reaps it
        return killed
