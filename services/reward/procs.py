"""One pool process as the service sees it: started from the fork server, asked one thing at a time
over its own pipe, waited on without a thread (the event loop watches the pipe and the process's
exit sentinel), and killed with everything it started when it runs past its time or is given up."""

from __future__ import annotations

import asyncio
import threading
import time
from multiprocessing.context import BaseContext
from typing import Any

from services.reward import proctree, worker

_STARTING = threading.Lock()


class ProcessDied(RuntimeError):
    """The pool process ended while it had a request: `exitcode` as multiprocessing reports it."""

    def __init__(self, exitcode: int | None) -> None:
        self.exitcode = exitcode
        how = f"signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
        super().__init__(f"the scoring process died ({how})")


class PoolProcess:
    def __init__(self, ctx: BaseContext, preload: list[str]) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self._child = child
        # not daemonic: a reward function may start processes of its own (multiprocessing refuses
        # that in a daemon); the service kills pool processes itself, and one whose service died
        # kills itself (the worker's lifeline thread)
        self.proc = ctx.Process(target=worker.serve, args=(child, preload), name="jetrl-reward-pool")  # type: ignore[attr-defined]
        self.tasks = 0
        """Requests answered, for `max_tasks_per_process`."""
        self.busy_since: float | None = None
        """monotonic time its current request was sent; None while idle."""

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    async def start(self, timeout_s: float) -> None:
        """Start it and wait for its "ready" (it has imported the allowed modules)."""
        await asyncio.to_thread(self._start)  # talks to the fork server: not in the event loop
        self._child.close()
        reply = await self._receive(timeout_s)
        if not (isinstance(reply, tuple) and reply[:1] == ("ready",)):
            raise RuntimeError(f"a new scoring process sent {reply!r:.80} instead of ready")

    def _start(self) -> None:
        with _STARTING:  # multiprocessing's bookkeeping of started processes is not thread-safe
            self.proc.start()

    async def call(self, op: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        """Send one request and wait for its reply: `TimeoutError` past `timeout_s`, `ProcessDied`
        if it ends first. Either way the caller must `kill` it: it is not reused."""
        self.busy_since = time.monotonic()
        try:
            try:
                self.conn.send((op, args))
            except OSError:  # it died while idle: its pipe is closed
                raise ProcessDied(await self.exitcode()) from None
            return await self._receive(timeout_s)
        finally:
            self.busy_since = None

    async def _receive(self, timeout_s: float) -> Any:
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not readable.done():
                readable.set_result(None)

        def expire() -> None:
            if not readable.done():
                readable.set_exception(TimeoutError(f"no reply within {timeout_s:g} s"))

        # the sentinel too: a child the function forked may hold the pipe open after the process died
        fds = (self.conn.fileno(), self.proc.sentinel)
        for fd in fds:
            loop.add_reader(fd, wake)
        timer = loop.call_later(timeout_s, expire)  # cheaper per item than wait_for
        try:
            await readable
        finally:
            timer.cancel()
            for fd in fds:
                loop.remove_reader(fd)
        try:
            if self.conn.poll():
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        raise ProcessDied(await self.exitcode())

    async def exitcode(self) -> int | None:
        await asyncio.to_thread(self.proc.join, 5.0)
        return self.proc.exitcode

    def kill(self) -> int:
        """SIGKILL it, its process group and its descendants; returns how many of those it had."""
        self.conn.close()
        self._child.close()  # already closed once started; not if it never started
        if self.proc.pid is None:
            return 0
        killed = proctree.kill_tree(self.proc.pid)
        self.proc.join(1.0)  # SIGKILLed: its exit is immediate, this only reaps it
        return killed

    def close(self) -> None:
        """Ask it to exit (its pipe closes: it leaves its loop) without waiting."""
        self.conn.close()
