"""Version gating: a prompt's episode starts only once this worker's inference servers hold at least
the prompt's `min_version`, so no group is generated with weights the trainer will refuse.

The worker asks each of its servers (`InferenceEngine.get_weight_version`, from the server's
`/model_info`) and takes the lowest answer: an episode may go to any of them. The answer is
cached; it is read again when a prompt needs more than the cache says, at once when any server of the
run reports a load on `jetrl.<run>.weights.loaded.*`, else every `poll_s` while a prompt waits. One read
serves every waiting prompt. A server that does not answer is left out (the engine fails over from it
too); if none answers, prompts keep waiting. Before it pulls its first prompt the worker waits until
at least one server answers at all (`wait_servable`): in a deployment that starts every service at
once, a worker is ready long before a server has loaded its model, and an episode sent meanwhile can
only fail. Versions only grow, except when a server restarts on
older weights: a cached answer older than `max_age_s` is read again before it lets a prompt through.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.client import Client as NATS

from schemas.subjects import Subjects
from services.common.bus import unsubscribe_quietly
from services.common.logging import get_logger

log = get_logger("rollout.gate")


class VersionGate:
    def __init__(self, engine: Any, *, poll_s: float = 0.5, servable_poll_s: float = 0.1, max_age_s: float = 10.0,
                 warn_after_s: float = 30.0) -> None:
        self.engine = engine
        self.poll_s = poll_s
        self.servable_poll_s = servable_poll_s
        """`wait_servable`'s poll: while no server serves yet (at start)."""
        self.max_age_s = max_age_s
        self.warn_after_s = warn_after_s
        self.version: int | None = None
        """Lowest version among the servers that answered at the last read (None: never read)."""
        self._read_at = 0.0
        self._reading: asyncio.Task[None] | None = None
        self._loaded = asyncio.Event()
        self._sub: Any = None
        self.waits = 0
        """Prompts that had to wait (their servers were behind when they arrived)."""
        self.waited_s = 0.0

    @property
    def enabled(self) -> bool:
        """An engine that cannot say its servers' versions (a test double) gates nothing."""
        return hasattr(self.engine, "get_weight_version") and bool(getattr(self.engine, "servers", None))

    async def follow_loads(self, nc: NATS, run: str) -> None:
        """Wake waiting prompts as soon as any server of the run reports a load (core subscription:
        a missed report only delays a prompt until the next poll)."""

        async def on_loaded(_msg: Any) -> None:
            self._loaded.set()

        self._sub = await nc.subscribe(Subjects(run).weights_loaded_all, cb=on_loaded)

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        await unsubscribe_quietly(sub, "weights.loaded")

    def _fresh(self, min_version: int) -> bool:
        return self.version is not None and self.version >= min_version and time.monotonic() - self._read_at < self.max_age_s

    async def wait(self, min_version: int, prompt_id: str = "") -> float:
        """Return once every answering server holds `min_version` or newer; the seconds waited."""
        if min_version <= 0 or not self.enabled or self._fresh(min_version):
            return 0.0
        t0 = time.monotonic()
        warned = held = False
        while True:
            self._loaded.clear()
            await self._read()
            if self._fresh(min_version):
                break
            held = True
            waited = time.monotonic() - t0
            if not warned and waited >= self.warn_after_s:
                warned = True
                log.warning("prompt still waiting for its weight version", prompt_id=prompt_id,
                            min_version=min_version, servers_hold=self.version, waited_s=round(waited, 1))
            try:
                await asyncio.wait_for(self._loaded.wait(), timeout=self.poll_s)
            except TimeoutError:
                pass
        waited = time.monotonic() - t0
        if held:
            self.waits += 1
            self.waited_s += waited
        return waited

    async def wait_servable(self, stopping: asyncio.Event) -> float:
        """Return once at least one server answers with its weight version (it has loaded a model and
        serves), or `stopping` is set; the seconds waited. A load report wakes it at once."""
        if not self.enabled:
            return 0.0
        t0 = time.monotonic()
        warned = False
        while not stopping.is_set():
            self._loaded.clear()
            await self._read()
            if self.version is not None:
                break
            waited = time.monotonic() - t0
            if not warned and waited >= self.warn_after_s:
                warned = True
                log.warning("no inference server serves yet; not pulling prompts", servers=list(self.engine.servers),
                            waited_s=round(waited, 1))
            stop = asyncio.ensure_future(stopping.wait())
            loaded = asyncio.ensure_future(self._loaded.wait())
            try:
                await asyncio.wait({stop, loaded}, timeout=self.servable_poll_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                loaded.cancel()
        return time.monotonic() - t0

    async def _read(self) -> None:
        """One read of every server's version, shared by every prompt waiting meanwhile."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read_servers(), name="weight-version-read")
        await asyncio.shield(self._reading)

    async def _read_servers(self) -> None:
        servers = list(self.engine.servers)
        answers = await asyncio.gather(*(self.engine.get_weight_version(s) for s in servers), return_exceptions=True)
        versions = [a for a in answers if isinstance(a, int)]
        for server, answer in zip(servers, answers, strict=True):
            # before any server has answered (a start beside loading servers) `wait_servable` warns instead
            if isinstance(answer, BaseException) and self.version is not None:
                log.info("server did not say its weight version; left out of the gate", server=server, error=repr(answer))
        if versions:
            self.version, self._read_at = min(versions), time.monotonic()
