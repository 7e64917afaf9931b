"""`jetrl up` watches its embedded nats-server's store: a full disk is an alert, and the run goes on
when space returns.

Every `every_s` the server's health report (`/healthz?details=true`, services/common/storefull.py)
is read. A stream it cannot write is logged at error level, naming the stream and the store's free
space, counted, and shown by the live display until it is writable again. nats-server keeps failing
a stream's block after a write error even once space has returned, until it restarts: so when the
store's filesystem has `min_free_bytes` free again, the server is restarted on the same ports and
store (its messages kept); the services reconnect by themselves, as after any outage.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass, field

from services.common.logging import get_logger
from services.common.nats_server import NatsServer
from services.common.storefull import describe, store_errors

log = get_logger("up")


@dataclass
class StoreState:
    """What the display, the summary and metrics.json show of the store."""

    full: dict[str, str] = field(default_factory=dict)
    """{stream: nats-server's write error}, now."""
    times_full: dict[str, int] = field(default_factory=dict)
    """How often each stream became unwritable in this run."""
    restarts: int = 0
    """nats-server restarts made to clear write errors after space returned."""

    def line(self) -> str:
        return describe(self.full) if self.full else ""


class StoreWatch:
    def __init__(self, server: NatsServer, state: StoreState, min_free_bytes: int, every_s: float = 1.0,
                 restart_gap_s: float = 30.0) -> None:
        self.server = server
        self.state = state
        self.min_free_bytes = min_free_bytes
        self.every_s = every_s
        self.restart_gap_s = restart_gap_s
        self._next = 0.0
        self._restarted = -1.0

    @property
    def monitor_url(self) -> str:
        return f"http://{self.server.host}:{self.server.monitor_port}"

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.server.store_dir).free

    async def check(self) -> None:
        """Read the server's health (at most every `every_s`); log what changed; restart the server
        when space has returned under a stream it still cannot write."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        try:
            errors = await asyncio.to_thread(store_errors, self.monitor_url, 2.0)
        except OSError:  # not answering: a restart of ours that failed is tried again
            proc = self.server.proc
            if self._restarted >= 0 and proc is not None and proc.poll() is not None and now - self._restarted >= self.restart_gap_s:
                self._restarted = now
                await asyncio.to_thread(self._restart)
            return
        free = await asyncio.to_thread(self.free_bytes)
        for stream in sorted(errors.keys() - self.state.full.keys()):
            self.state.times_full[stream] = self.state.times_full.get(stream, 0) + 1
            log.error("the JetStream store is full: nats-server cannot write a stream; the run waits until space returns "
                      "(docs/security.md \"A full disk\")", stream=stream, store=str(self.server.store_dir),
                      free_mb=round(free / 1e6, 1), error=errors[stream])
        for stream in sorted(self.state.full.keys() - errors.keys()):
            log.info("stream writable again", stream=stream)
        self.state.full = errors
        if errors and free >= self.min_free_bytes and (self._restarted < 0 or now - self._restarted >= self.restart_gap_s):
            self._restarted = now
            self.state.restarts += 1
            log.warning("space returned on the store's filesystem: restarting nats-server, which keeps failing a "
                        "stream's block after a write error until it restarts", streams=sorted(errors),
                        free_mb=round(free / 1e6, 1))
            await asyncio.to_thread(self._restart)

    def _restart(self) -> None:
        self.server.stop()
        try:
            self.server.restart()
        except (OSError, RuntimeError) as exc:  # tried again after restart_gap_s
            log.error("nats-server did not start again; trying again later", error=str(exc), log=str(self.server.log_file))
            return
        log.info("nats-server restarted; the services reconnect", url=self.server.url)
