"""`jetrl replay` as a process: the trainer's engine and step, fed from a recorded range (the stream
or Parquet exports) instead of the live consumer. No feeder, no inference, no weight agents.

It ends when the range is exhausted (or after `total_steps`), with a checkpoint; SIGTERM finishes the
current step, checkpoints and exits. It always connects to NATS, Parquet input included: the trainer
publishes its metrics there (and its weights, with a `weights.transport`). `resume=auto` continues after the checkpoint's last sequence.
Launch: `jetrl replay ...` (1 rank) or `torchrun --nproc_per_node N -m services.replay ...`.
"""

from __future__ import annotations

import asyncio
import functools

from nats.aio.client import Client as NATS

from services.common.bus import Bus
from services.common.logging import get_logger
from services.common.runner import Supervisor, supervise
from services.replay.settings import ReplaySettings
from services.replay.source import RecordingSource, replay_window
from services.trainer.intake.intake import Intake
from services.trainer.loop import Trainer
from services.trainer.model.engine import TrainEngine
from services.trainer.service import run_ranks, weight_sync
from services.weights.sender.sync import WeightSync

log = get_logger("replay")


async def start_replay(settings: ReplaySettings, engine: TrainEngine, nc: NATS, weights: WeightSync | None = None,
                       bus: Bus | None = None) -> Trainer:
    """A started Trainer whose groups come from the recording (resumed from a checkpoint if asked: the
    recording is read after the checkpoint's last consumed sequence). `bus`: the service's (default:
    from the settings)."""
    on = bus if bus is not None else Bus.of(settings)

    def recording(intake: Intake) -> RecordingSource:
        return RecordingSource(settings, intake, retry=on.retry)

    trainer = Trainer(settings, engine, weights=weights, source=recording, window=replay_window(settings), bus=on)
    await trainer.start(nc)
    log.info("replay started", source="parquet" if settings.parquet else f"stream:{settings.source_run}",
             after_seq=trainer.last_seq, version=trainer.version, staleness=settings.staleness)
    return trainer


async def replay(trainer: Trainer, stopping: asyncio.Event) -> None:
    """Train until the range is exhausted, total_steps, or a stop; then checkpoint (`Trainer.run`)."""
    from services.common.progress import Progress

    src = trainer.source
    assert isinstance(src, RecordingSource), "replay: a trainer started by start_replay"
    total = trainer.settings.total_steps - trainer.version if trainer.settings.total_steps else None
    progress = Progress("replay", "steps", total, version=trainer.version)
    await trainer.run(stopping, lambda _: progress.advance(version=trainer.version, last_seq=trainer.last_seq, read=src.read))
    log.info("replay finished" if src.exhausted or trainer.done else "replay stopped", version=trainer.version,
             last_seq=trainer.last_seq, read=src.read, malformed=src.malformed, skipped=src.skipped)


async def run_service(settings: ReplaySettings, bus: Bus) -> None:
    await run_ranks(settings, functools.partial(_run_rank0, bus=bus))


async def _run_rank0(settings: ReplaySettings, engine: TrainEngine, *, bus: Bus) -> None:
    try:
        nc = await bus.connect(f"jetrl-replay-{settings.run}", connect_timeout_s=settings.connect_timeout_s)
    except ConnectionError as exc:
        if not settings.parquet:
            raise
        # the groups come from files, but the trainer's metrics (and published weights) go to NATS
        raise ConnectionError(
            f"{exc}. jetrl replay needs a NATS server even for Parquet input: its step metrics (and its "
            "weights, with a weights.transport) are published there. Start one, e.g. `jetrl nats --store-dir "
            ".jetrl/nats-offline`, and pass nats_url=nats://127.0.0.1:4222"
        ) from exc
    try:
        weights = weight_sync(settings, nc, bus)

        async def main(sup: Supervisor) -> None:
            sup.stack.push_async_callback(weights.aclose)
            trainer = await start_replay(settings, engine, nc, weights, bus)

            async def run() -> None:
                try:
                    await replay(trainer, sup.stopping)
                    await trainer.stop_followers()
                finally:
                    sup.stop()

            sup.spawn("replay", run())

        await supervise("replay", main, settings.shutdown_timeout_s, retry=bus.retry)
    finally:
        try:
            await asyncio.wait_for(nc.drain(), timeout=5.0)
        except Exception as exc:  # the bus may be gone; exiting matters more
            log.warning("nats drain failed", error=repr(exc))
