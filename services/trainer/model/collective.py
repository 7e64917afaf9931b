"""Rank 0 drives; the other ranks follow. Rank 0 pulls from the bus and scatters one command per
rank (its share of the step); every rank then runs the same collective work (`execute`). Ranks other
than 0 never touch NATS: they loop on `follow` until told to stop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from services.trainer.model import memory
from services.trainer.model.actor import PPOActor
from services.trainer.model.engine import TrainEngine
from services.trainer.model.gather import StreamSpec, gather_stream
from services.weights.sender.bucket_stream import BucketStream


@dataclass
class Command:
    op: str
    """train | weights | save | load | stop"""
    pieces: list[dict[str, Any]] = field(default_factory=list)
    """train: this rank's piece of each mini-batch."""
    weights_dir: str | None = None
    """train: after the update, gather the weights and write a HF dir here (rank 0); weights: the same,
    without an update (a resumed trainer publishing its restored weights)."""
    weights_state: bool = False
    """train: after the update, gather the weights into memory for the broadcast (rank 0)."""
    weights_stream: StreamSpec | None = None
    """train: after the update, gather the weights bucket by bucket into rank 0's stream (the sink
    `execute` is given there), each handed to the broadcast as it is gathered."""
    directory: str = ""
    tag: str | None = None
    client_state: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    stats: dict[str, float] = field(default_factory=dict)
    weights_dir: Path | None = None
    state: dict[str, Any] | None = None
    """The gathered float32 parameters (rank 0, when asked by `weights_state`)."""
    client_state: dict[str, Any] = field(default_factory=dict)


def scatter(commands: list[Command]) -> Command:
    """On rank 0: send commands[r] to rank r and return commands[0]. Elsewhere use `receive`."""
    if len(commands) == 1:
        return commands[0]
    out: list[Any] = [None]
    dist.scatter_object_list(out, commands, src=0)
    return out[0]


def receive() -> Command:
    out: list[Any] = [None]
    dist.scatter_object_list(out, None, src=0)
    return out[0]


def execute(engine: TrainEngine, actor: PPOActor, cmd: Command, sink: BucketStream | None = None) -> Result:
    """The collective work of one command; identical on every rank. `sink`: rank 0's stream of the
    broadcast when `cmd.weights_stream` (a thread-safe object of this process: it cannot travel in
    the command, which is pickled to every rank)."""
    if cmd.op == "train":
        stats = actor.ppo_update(cmd.pieces)
        t0 = time.perf_counter()
        if cmd.weights_stream is not None:  # first: the servers get the version before the disk copy
            gather_stream(engine, cmd.weights_stream, sink)
        weights = engine.upload_weights(cmd.weights_dir) if cmd.weights_dir else None
        state = engine.full_state_dict() if cmd.weights_state else None
        if cmd.weights_dir or cmd.weights_state or cmd.weights_stream:  # part of what publishing costs the step
            stats = {**stats, "weights_gather_s": time.perf_counter() - t0}
        # what the step freed goes back to the system, when there is enough of it to be worth the faults (memory.py)
        trim_s, free = memory.release_if_free(int(engine.settings.trim_free_mb * 2**20))
        now, peak = memory.resident()
        stats = {**stats, "trim_s": trim_s, **({"heap_free_mib": free / 2**20} if free is not None else {}),
                 "resident_gib": now / 2**30, "peak_resident_gib": peak / 2**30,
                 **{f"resident_{kind}_gib": size / 2**30 for kind, size in memory.resident_parts().items()}}
        return Result(stats=stats, weights_dir=weights, state=state)
    if cmd.op == "weights":
        return Result(weights_dir=engine.upload_weights(cmd.weights_dir) if cmd.weights_dir else None)
    if cmd.op == "save":
        engine.save(cmd.directory, cmd.tag or "latest", cmd.client_state)
        return Result()
    if cmd.op == "load":
        return Result(client_state=engine.load(cmd.directory, cmd.tag))
    if cmd.op == "stop":
        return Result()
    raise ValueError(f"unknown trainer command {cmd.op!r}")


def follow(engine: TrainEngine, actor: PPOActor) -> None:
    """The loop of every rank but 0: receive a command, run it, until `stop`."""
    while True:
        cmd = receive()
        execute(engine, actor, cmd)
        if cmd.op == "stop":
            return
