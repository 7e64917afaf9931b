"""The tracker's loop: an ordered consumer on the run's METRICS subjects; each event becomes one row
of `<service>[.<worker>]/<figure>` values at the trainer's step (rollout and reward figures carry the
latest trainer step seen, so every chart shares one x-axis)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from nats.js.api import DeliverPolicy

from schemas.messages import MessageError, MetricsEvent, decode
from schemas.subjects import METRICS_STREAM, Subjects
from services.common.bus import Bus, close_connection
from services.common.logging import get_logger
from services.common.runner import Supervisor, supervise
from services.runs import run_bus
from services.track.settings import TrackSettings
from services.track.sinks import Guarded, Sink, TensorBoardSink, WandbSink

log = get_logger("track")


def open_sinks(s: TrackSettings) -> list[Guarded]:
    """Every sink that is on and opens; one that fails to open is logged and left out."""
    wanted: list[tuple[str, Callable[[], Sink]]] = []
    if s.tensorboard.log_dir:
        wanted.append(("tensorboard", lambda: TensorBoardSink(s.tensorboard.log_dir, s.tensorboard.flush_s)))
    if s.wandb.mode != "disabled":
        w = s.wandb
        wanted.append(("wandb", lambda: WandbSink(w.mode, w.project, w.entity, w.dir, w.name or s.run)))
    if not wanted:
        raise ValueError("jetrl track: no sink is on; set tensorboard.log_dir and/or wandb.mode (offline or online)")
    opened = []
    for name, make in wanted:
        try:
            opened.append(Guarded(make(), s.max_failures))
        except Exception as exc:
            log.error("tracker could not be opened; going on without it", sink=name, error=repr(exc))
    if not opened:
        raise RuntimeError(f"jetrl track: none of the sinks could be opened ({', '.join(n for n, _ in wanted)}); see the log")
    return opened


def load_config(path: str) -> dict[str, Any]:
    if not path:
        return {}
    text = Path(path).read_text()
    loaded = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    if not isinstance(loaded, dict):
        raise ValueError(f"config_path {path}: expected a mapping at the top, got {type(loaded).__name__}")
    return loaded


def row_of(event: MetricsEvent) -> dict[str, float]:
    prefix = event.service if not event.worker or event.service == "trainer" else f"{event.service}.{event.worker}"
    return {f"{prefix}/{key}": value for key, value in event.values.items()}


class Tracker:
    def __init__(self, settings: TrackSettings, sinks: list[Guarded]) -> None:
        self.settings = settings
        self.sinks = sinks
        self.step = 0
        self.events = 0
        self.malformed = 0

    def handle(self, data: bytes) -> None:
        try:
            event = decode(MetricsEvent, data)
        except MessageError as exc:
            self.malformed += 1
            log.warning("metrics event does not decode; skipped", error=str(exc), malformed=self.malformed)
            return
        if event.service == "trainer" and event.step is not None:
            self.step = max(self.step, event.step)
        row = row_of(event)
        if row:
            self.events += 1
            for sink in self.sinks:
                sink.call("write", row, self.step)

    def stats(self) -> dict[str, Any]:
        return {"events": self.events, "malformed": self.malformed, "step": self.step,
                "sinks": {g.name: {"rows": g.rows, "failures": g.failures, "off": g.off} for g in self.sinks}}


async def run(settings: TrackSettings, bus: Bus) -> None:
    async def main(sup: Supervisor) -> None:
        config = load_config(settings.config_path)
        sinks = await asyncio.to_thread(open_sinks, settings)
        tracker = Tracker(settings, sinks)
        for sink in sinks:
            sink.call("log_config", {"run": settings.run, **config})
        url, auth = run_bus(Path(settings.run_dir) / settings.run, "track", settings.nats_url, settings.model_fields_set)
        # the run's `track` user, if found: `jetrl up` declared the streams, it only looks them up
        on = bus.as_user(auth, declare=False) if auth is not None else bus
        nc = await on.connect(f"jetrl-track-{settings.run}", connect_timeout_s=settings.connect_timeout_s, url=url)
        sup.stack.push_async_callback(close_connection, nc)
        await on.declare_streams(nc.jetstream())
        policy = DeliverPolicy.ALL if settings.from_start else DeliverPolicy.NEW
        sub = await nc.jetstream().subscribe(Subjects(settings.run).metrics_all, ordered_consumer=True,
                                             deliver_policy=policy, stream=METRICS_STREAM)

        async def follow() -> None:
            flush_every = max(1.0, settings.tensorboard.flush_s)
            loop = asyncio.get_running_loop()
            flushed = loop.time()
            while not sup.stopping.is_set():
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except TimeoutError:
                    msg = None
                if msg is not None:
                    await asyncio.to_thread(tracker.handle, msg.data)
                if loop.time() - flushed >= flush_every:
                    for sink in sinks:
                        await asyncio.to_thread(sink.call, "flush")
                    flushed = loop.time()
            await sub.unsubscribe()
            for sink in sinks:
                await asyncio.to_thread(sink.call, "close")
            log.info("tracker stopped", **tracker.stats())

        log.info("tracking", sinks=[g.name for g in sinks], from_start=settings.from_start)
        sup.spawn("follow", follow())

    await supervise("track", main, settings.shutdown_timeout_s, retry=bus.retry)
