"""A trainer with a feeder that starts without a checkpoint starts the run afresh, even when the run
name was used before on this server: what that earlier incarnation left must not be taken for answers
to the new prompts (same seed, same row order, so the same prompt ids).

- its recorded trajectories are skipped: the trainer's consumer starts after the stream's last
  sequence at start (saved as `last_seq`, so a resume from an early checkpoint skips them too);
- its queued prompts (train and eval) are purged from the work queue;
- the new prompt ids get a tag, so answers to its prompts still being worked on are told apart
  (`foreign`) and JetStream's de-duplication cannot drop our answers as repeats of theirs;
- a weight version it announced is only warned about: agents serve it until this trainer publishes.
A new run name avoids all of this.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from schemas.messages import MessageError, WeightsPublished, decode
from schemas.subjects import PROMPTS_STREAM, TRAJECTORIES_STREAM, WEIGHT_SYNC_STREAM, Subjects
from services.common.logging import get_logger

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


async def clear_leftovers(js: JetStreamContext, subjects: Subjects) -> Leftovers:
    """Measure and drop what an earlier incarnation of the run left; warn about what cannot be dropped."""
    info = await js.stream_info(TRAJECTORIES_STREAM, subjects_filter=subjects.trajectories)
    trajectories = sum((info.state.subjects or {}).values())
    prompts = await _count(js, PROMPTS_STREAM, subjects.prompts_all)
    if prompts:
        await js.purge_stream(PROMPTS_STREAM, subject=subjects.prompts_all)
    found = Leftovers(info.state.last_seq, trajectories, prompts, await _announced_version(js, subjects))
    if found.used_before:
        log.warning(
            "run name used before; starting it afresh (a new run name avoids this)", run=subjects.run,
            recorded_trajectories_ignored=trajectories, queued_prompts_dropped=prompts,
        )
    if found.weights_version is not None:
        log.warning(
            "weights of an earlier incarnation are announced for this run; inference serves them until this "
            "trainer publishes version 1", run=subjects.run, announced_version=found.weights_version, version=0,
        )
    return found


async def _count(js: JetStreamContext, stream: str, subject: str) -> int:
    info = await js.stream_info(stream, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def _announced_version(js: JetStreamContext, subjects: Subjects) -> int | None:
    try:
        msg = await js.get_last_msg(WEIGHT_SYNC_STREAM, subjects.weights_published)
        return decode(WeightsPublished, msg.data or b"").version
    except NotFoundError:
        return None
    except MessageError as exc:  # something is announced; what, we cannot tell
        log.warning("weights announcement does not decode", error=str(exc))
        return -1
