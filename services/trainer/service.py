"""`jetrl trainer` as a service: every rank builds the engine; rank 0 connects to NATS and runs the
`Trainer` under the supervisor (its feeder, the training loop), the other ranks follow its
commands. SIGTERM: finish the current step, checkpoint, release the other ranks, exit.

Launch: `jetrl trainer ...` (1 rank) or `torchrun --nproc_per_node N -m services.trainer ...`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import torch.distributed as dist
from nats.aio.client import Client as NATS

from schemas.trajectory.warm import warm_up
from services.common.bus import Bus, close_connection
from services.common.logging import bind_context, get_logger
from services.common.model_path import require_model
from services.common.runner import Supervisor, supervise
from services.trainer.loop import Trainer
from services.trainer.model import checkpoint as ckpt
from services.trainer.model.actor import PPOActor
from services.trainer.model.collective import follow
from services.trainer.model.engine import TrainEngine
from services.trainer.model.gather import streamable
from services.trainer.settings import TrainerSettings
from services.weights.sender.factory import make_weight_sync
from services.weights.sender.sync import WeightSync

log = get_logger("trainer")


async def run_service(settings: TrainerSettings, bus: Bus) -> None:
    fresh = ckpt.resolve_resume(settings.resume, settings.output_dir) is None
    await run_ranks(settings, functools.partial(_run_rank0, bus=bus), early=fresh)
    # Checkpointed and closed: exit now, not after a worker thread still blocked in a call to a bus or a
    # weight-update group that is gone (the interpreter would wait for it, past shutdown_timeout_s).
    _exit(0)


async def run_ranks(settings: TrainerSettings, rank0: Callable[[Any, Any], Awaitable[None]], *, early: bool = False) -> None:
    """Every rank builds the engine; rank 0 runs `rank0(settings, engine)`, the others follow its
    commands. Shared by `jetrl trainer` and `jetrl replay`. `early`: rank 0 gets the engine's build
    as a task instead and starts before it is done (a fresh start needs no engine to begin feeding)."""
    require_model(settings.model_path)  # a model name this machine does not have: fail now, saying what to do
    if early:
        _import_heavy()
    building = asyncio.ensure_future(_build_engine(settings))
    if early and _rank() == 0:
        await _rank0(settings, building, rank0)
        return
    engine = await building
    if engine.rank != 0:
        await asyncio.to_thread(follow, engine, PPOActor(engine, settings.ppo))
        dist.barrier()
        _exit(0)
    await _rank0(settings, engine, rank0)


async def _build_engine(settings: TrainerSettings) -> TrainEngine:
    t0 = time.perf_counter()
    engine = await asyncio.to_thread(TrainEngine, settings)
    bind_context(rank=engine.rank)
    # the engine (DeepSpeed's init, the model) is most of a trainer's start: its time, and the process's
    # CPU-seconds so far (imports included; on a busy machine the wall time says little), for start-up reports
    log.info("engine ready", seconds=round(time.perf_counter() - t0, 2), cpu_s=round(time.process_time(), 2),
             torch_threads=torch.get_num_threads(), cpus=sorted(os.sched_getaffinity(0)), device=str(engine.device),
             dtype=settings.dtype)
    return engine


def _import_heavy() -> None:
    """DeepSpeed and transformers' auto classes, imported before the engine's thread starts: the
    event loop's side (`model_limits`, ...) and the build would otherwise import transformers' lazy
    modules from two threads at once, which fails ("cannot import name 'AutoConfig'")."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    from services.trainer.model.engine import import_deepspeed

    import_deepspeed()


def _rank() -> int:
    """This process's rank before the process group exists (torchrun's RANK; 0 alone)."""
    return int(os.environ.get("RANK", "0"))


async def _rank0(settings: TrainerSettings, engine: TrainEngine | asyncio.Future[TrainEngine],
                 rank0: Callable[[Any, Any], Awaitable[None]]) -> None:
    failed = True
    try:
        await rank0(settings, engine)
        failed = False
    finally:
        built = engine if isinstance(engine, TrainEngine) else (engine.result() if engine.done() and not engine.cancelled()
                                                                 and engine.exception() is None else None)
        if built is not None and built.world_size > 1:
            # Ending with barrier + os._exit avoids the ZeRO-3 abort at interpreter exit
            # (docs/reference/deepspeed-cpu.md). On failure the other ranks lose rank 0 and die.
            if not failed:
                dist.barrier()
            _exit(1 if failed else 0)


async def _run_rank0(settings: TrainerSettings, engine: TrainEngine | asyncio.Future[TrainEngine], *, bus: Bus) -> None:
    """`engine` still being built (a fresh start): the trainer starts (leftovers cleared, consumer and
    feeder open, the first prompts issued) while DeepSpeed initialises, so the rollout workers generate
    the first batch meanwhile; training starts once the engine is there."""
    nc = await bus.connect(f"jetrl-trainer-{settings.run}")
    try:
        weights = weight_sync(settings, nc, bus)
        ready = engine if isinstance(engine, TrainEngine) else None
        trainer = Trainer(settings, ready, weights=weights, bus=bus)

        async def main(sup: Supervisor) -> None:
            sup.stack.push_async_callback(weights.aclose)
            sup.spawn("weights-prepare", weights.prepare())  # e.g. the broadcast's group, during the engine's build
            await trainer.start(nc)
            sup.stack.push_async_callback(trainer.close)
            if trainer.feeder is not None:
                sup.spawn("feeder", trainer.feeder.feed_forever(sup.stopping))
            sup.spawn("train", _train(trainer, sup, None if isinstance(engine, TrainEngine) else engine))

        await supervise("trainer", main, settings.shutdown_timeout_s, retry=bus.retry)
    finally:
        await close_connection(nc)  # the bus may be gone: then closed at once, exiting matters more


def weight_sync(settings: TrainerSettings, nc: NATS, bus: Bus) -> WeightSync:
    """The trainer's `WeightSync`, as `weights.transport` names it (`jetrl trainer`, `jetrl replay`);
    `bus`: the replicas and declare policy of the stream and bucket it declares."""
    return make_weight_sync(settings.weights, nc, settings.run, retry_s=settings.bus_retry_timeout_s,
                            announce_key=settings.trust.announce(), inference_keys=settings.trust.inference_keys,
                            streamed=streamable(settings), bus=bus)


async def _train(trainer: Trainer, sup: Supervisor, building: asyncio.Future[TrainEngine] | None = None) -> None:
    try:
        # pyarrow's first conversion (pandas' import) while the engine builds or the first batch comes,
        # not inside the first batch's decode
        warming = asyncio.to_thread(warm_up)
        if building is not None:  # the feeder and the consumer are at work meanwhile
            engine, _ = await asyncio.gather(building, warming)
            trainer.attach_engine(engine)
        else:
            await warming
        await trainer.run(sup.stopping)
        # Only on success: after a failure inside a collective the other ranks cannot take a command;
        # rank 0 exits and they die with the broken process group.
        await trainer.stop_followers()
    finally:
        sup.stop()


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
