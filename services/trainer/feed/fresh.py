"""A trainer with a feeder that starts without a checkpoint starts the run afresh, even when the run
name was used before on this server: what that earlier incarnation left must not be taken for answers
to the new prompts (same seed, same row order, so the same prompt ids).

- its recorded trajectories are skipped: the trainer's consumer starts after the stream's last
  sequence at start (saved as `last_seq`, so a resume from an early checkpoint skips them too);
- its queued prompts (train and eval) are purged from the work queue;
- the new prompt ids get a tag, so answers to its prompts still being worked on are told apart
  (`foreign`) and JetStream's de-duplication cannot drop our answers as repeats of theirs;
- a weight version N it announced is served by the inference servers (their agents loaded it, and a
  server started later loads it too): the new trainer continues the numbering past it. It publishes
  its base weights (`model_path`, "version 0") as version N+1 and counts from there (`first_version`):
  prompts ask for N+1 or newer, and a group generated with older weights is the earlier run's, never
  trained (`stale`, cause `earlier_run`). Starting again at version 1 instead would train nothing:
  every group would carry version N, newer than the trainer, and be terminated as impossible.
A new run name avoids all of this.

A trainer resumed from a checkpoint (version C) after it was killed past it has the same problem in
small: the version N it announced before dying is served, and versions C+1..N are weights nobody holds
any more. It publishes its restored weights as N+1 and moves its numbering by N+1-C (the loop's
`_catch_up`); what the killed incarnation's prompts produced is set apart like an earlier run's.
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from schemas.messages import MessageError, WeightsPublished, decode
from schemas.subjects import PROMPTS_STREAM, TRAJECTORIES_STREAM, WEIGHT_SYNC_STREAM, Subjects
from services.common.bus import js_api_call
from services.common.busretry import RetryPolicy
from services.common.logging import get_logger
from services.common.streaminfo import leader_stream_info

log = get_logger("trainer")


@dataclass(frozen=True)
class Leftovers:
    """What an earlier incarnation of the run left on the server."""

    start_seq: int
    """The TRAJECTORIES stream's last sequence before the new consumer: everything up to it is skipped."""
    trajectories: int
    prompts: int
    weights_version: int | None

    @property
    def used_before(self) -> bool:
        return bool(self.trajectories or self.prompts or self.weights_version is not None)

    @property
    def first_version(self) -> int:
        """The version this incarnation's base weights get: one past the announced one (0: none announced,
        or one that does not decode, whose version is unknown)."""
        return self.weights_version + 1 if self.weights_version is not None and self.weights_version >= 0 else 0


async def clear_leftovers(js: JetStreamContext, subjects: Subjects, policy: RetryPolicy) -> Leftovers:
    """Measure and drop what an earlier incarnation of the run left; warn about what cannot be dropped.
    (`policy`, here and below: the trainer's, `Bus.retry`.)"""
    info = await leader_stream_info(js, TRAJECTORIES_STREAM, subjects.trajectories, policy=policy)  # where the consumer starts
    trajectories = sum((info.state.subjects or {}).values())
    prompts = await purge_prompts(js, subjects, policy)
    found = Leftovers(info.state.last_seq, trajectories, prompts, await announced_version(js, subjects, policy))
    if found.used_before:
        log.warning(
            "run name used before; starting it afresh (a new run name avoids this)", run=subjects.run,
            recorded_trajectories_ignored=trajectories, queued_prompts_dropped=prompts,
        )
    return found


async def _count(js: JetStreamContext, stream: str, subject: str, policy: RetryPolicy) -> int:
    info = await leader_stream_info(js, stream, subject, policy=policy)
    return sum((info.state.subjects or {}).values())


async def purge_prompts(js: JetStreamContext, subjects: Subjects, policy: RetryPolicy) -> int:
    """Drop the run's queued prompts (train and eval); returns how many there were."""
    prompts = await _count(js, PROMPTS_STREAM, subjects.prompts_all, policy)
    if prompts:
        await js_api_call(f"stream {PROMPTS_STREAM}: purge the run's prompts",
                          functools.partial(js.purge_stream, PROMPTS_STREAM, subject=subjects.prompts_all), policy=policy)
    return prompts


async def announced_version(js: JetStreamContext, subjects: Subjects, policy: RetryPolicy) -> int | None:
    """The weight version last announced for the run (None: none; -1: one that does not decode)."""
    try:
        msg = await js_api_call(f"stream {WEIGHT_SYNC_STREAM}: last announced version",
                                functools.partial(js.get_last_msg, WEIGHT_SYNC_STREAM, subjects.weights_published), policy=policy)
        return decode(WeightsPublished, msg.data or b"").version
    except NotFoundError:
        return None
    except MessageError as exc:  # something is announced; what, we cannot tell
        log.warning("weights announcement does not decode", error=str(exc))
        return -1


def warn_served(found: Leftovers, run: str) -> None:
    """The announced version stays served: this trainer publishes no weights, or cannot read the version."""
    log.warning(
        "weights of an earlier incarnation are announced for this run; inference serves them until this "
        "trainer publishes a version (it continues the numbering past them only when it publishes weights and "
        "can read the announced version)", run=run, announced_version=found.weights_version, version=0,
    )


def log_continued(found: Leftovers, run: str) -> None:
    """The trainer continues the numbering past the announced version (module doc)."""
    log.warning(
        f"run {run} was used before: last announced version {found.weights_version}; starting at {found.first_version} "
        "(its base weights are published as that version; groups generated with older weights are not trained)",
        run=run, announced_version=found.weights_version, version=found.first_version,
    )


def log_caught_up(run: str, checkpoint_version: int, announced: int, prompts_dropped: int) -> None:
    """A resumed trainer continues the numbering past the version it announced before it was killed."""
    log.warning(
        f"resumed behind the announced weights: checkpoint version {checkpoint_version}, but version {announced} was "
        f"announced after it (the trainer was killed before checkpointing it); the restored weights are published as "
        f"version {announced + 1} and training goes on from there (groups generated with older weights are not trained)",
        run=run, checkpoint_version=checkpoint_version, announced_version=announced, version=announced + 1,
        queued_prompts_dropped=prompts_dropped,
    )


def warn_behind(run: str, checkpoint_version: int, announced: int) -> None:
    """Resumed behind the announced version, but this trainer publishes no weights: it cannot move past them."""
    log.warning(
        "resumed behind the announced weights, and this trainer publishes none: inference serves version "
        f"{announced} until an announcement replaces it; groups generated with it are newer than the trainer",
        run=run, checkpoint_version=checkpoint_version, announced_version=announced, version=checkpoint_version,
    )


WEIGHT_SUFFIXES_SKIPPED = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")
"""Other formats of the same weights a model directory may also hold: the servers load safetensors."""


def stage_base_weights(model_path: str | Path, dest: Path) -> Path:
    """`model_path`'s checkpoint (config, safetensors, tokenizer files: version 0 of the weights) as a
    fresh directory `dest` the publisher may take over. Files are hard-linked where the filesystem
    allows (nothing writes a published file in place), else copied."""
    src = Path(model_path)
    files = [p for p in sorted(src.iterdir()) if p.is_file() and not p.name.startswith(".")
             and p.suffix not in WEIGHT_SUFFIXES_SKIPPED] if src.is_dir() else []
    if not any(p.suffix == ".safetensors" for p in files):
        raise FileNotFoundError(
            f"model_path {src}: no *.safetensors to publish as this run's base weights (needed to continue the "
            "version numbering of a run name used before); use a new run name or a safetensors checkpoint")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for p in files:
        try:
            os.link(p, dest / p.name)
        except OSError:  # another filesystem, or links not allowed
            shutil.copy2(p, dest / p.name)
    return dest
