"""The trainer's read side of TRAJECTORIES: a durable pull consumer from which one step's groups are
collected through the intake (rejections, stale, zero-variance, duplicate and malformed messages are
counted and handled on the way).

It is the live trainer's `GroupSource` (`source.py`). Consumption is transactional: an accepted group
is held, its message unacknowledged, until the step that trains it is applied (`applied`); only then
is its message acknowledged, and the `last_seq` its collect returned taken as covered by the trainer.
A stop or a bus loss mid-collect therefore leaves the trainer's `last_seq` at the last trained step: a
checkpoint taken then makes a resume read the held groups again and train them, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas.subjects import TRAJECTORIES_STREAM, Subjects
from services.common.bus import unsubscribe_quietly
from services.common.busretry import Backoff, RetryPolicy, retryable
from services.common.consumers import add_consumer, delete_consumer_if_present
from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher
from services.common.poison import terminate_poison
from services.trainer.intake.intake import Group, Intake, Verdict
from services.trainer.intake.source import Collected
from services.trainer.settings import TrainerSettings

log = get_logger("trainer")


class TrajectoryConsumer:
    def __init__(self, settings: TrainerSettings, intake: Intake, *, on_judged: Callable[[], None] = lambda: None,
                 retry: RetryPolicy | None = None) -> None:
        """`on_judged`: called after each message judged and not trained (its prompt's slot is free);
        `retry`: the trainer's retry policy (`Bus.retry`; None: a fresh one)."""
        self.settings = settings
        self.intake = intake
        self.subjects = Subjects(settings.run)
        self.on_judged = on_judged
        self.retry = retry if retry is not None else RetryPolicy()
        self.read_seq = 0
        """Highest stream sequence judged so far (each collect returns it as its `last_seq`)."""
        self.nc: NATS | None = None
        self.metrics: MetricsPublisher | None = None
        self._sub: Any = None
        self._held: list[tuple[Group, Any]] = []
        """Accepted groups of the step being collected, each with its unacknowledged message: a collect
        cut short by a stop keeps them for the next one."""
        self._unjudged: list[Any] = []
        """Messages delivered beyond the batch being collected (not judged, not acked): the next step's first."""

    async def open(self, nc: NATS, metrics: MetricsPublisher | None, after_seq: int) -> None:
        """(Re)create the durable consumer so that it delivers right after `after_seq` (0: from the start).

        The checkpoint, not the server, is the truth about what was trained: messages acked after the
        checkpoint's sequence are trained again. Without a checkpoint: every recorded trajectory
        (offline, no feeder), or after the stream's end at a fresh start with a feeder."""
        self.nc, self.metrics = nc, metrics
        js = nc.jetstream()
        name = self.subjects.trainer_consumer
        # A bus still electing (a cluster forming, the stream's leader just lost) is waited out.
        await delete_consumer_if_present(js, TRAJECTORIES_STREAM, name, policy=self.retry)
        cfg = ConsumerConfig(
            durable_name=name, ack_policy=AckPolicy.EXPLICIT, filter_subject=self.subjects.trajectories,
            ack_wait=300.0, max_ack_pending=-1,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if after_seq else DeliverPolicy.ALL,
            opt_start_seq=after_seq + 1 if after_seq else None,
        )
        await add_consumer(js, TRAJECTORIES_STREAM, cfg, policy=self.retry)
        self._sub = await js.pull_subscribe_bind(name, stream=TRAJECTORIES_STREAM)

    async def close(self) -> None:
        """Stop reading, before the connection is drained: a pull request's late status left in the
        subscription's queue would hold the drain to its timeout. Nothing unacked is lost; JetStream
        redelivers it."""
        sub, self._sub = self._sub, None
        await unsubscribe_quietly(sub, "trajectory")

    @property
    def exhausted(self) -> bool:
        """A live stream never ends."""
        return False

    async def collect(self, version: int, stopping: asyncio.Event | None = None) -> Collected | None:
        """Pull until `batch_groups` groups are accepted at `version`; None if stopping first (the groups
        accepted so far stay held, untrained and unacknowledged: see the module doc)."""
        s, held = self.settings, self._held
        backoff = Backoff("fetch trajectories", s.bus_retry_timeout_s, policy=self.retry)
        while len(held) < s.batch_groups:
            if stopping is not None and stopping.is_set():
                return None
            if self._unjudged:  # delivered beyond the last step's batch: judged now, at this version
                msgs, self._unjudged = self._unjudged, []
                self._unjudged = await self._judge_into(held, msgs, version)
                continue
            try:
                # Never pull more than the step needs: later groups must be judged at a later version.
                msgs = await self._sub.fetch(min(s.fetch_batch, s.batch_groups - len(held)), timeout=s.fetch_timeout_s)
            except TimeoutError as exc:
                if self.nc is not None and not self.nc.is_connected:
                    # The server is away and the pull request waits: that counts towards giving up.
                    await backoff.failed(exc)
                else:  # nothing arrived
                    backoff.reset()
                continue
            except Exception as exc:
                await backoff.failed(exc)  # raises it when no retry can help
                continue
            backoff.reset()
            self._unjudged = await self._judge_into(held, msgs, version)
        return Collected([g for g, _ in held], self.read_seq)

    async def _judge_into(self, held: list[tuple[Group, Any]], msgs: list[Any], version: int) -> list[Any]:
        """Judge messages in order until the batch is full; returns the rest, unjudged. More can come
        than was asked for: pull requests made before a reconnect are answered after it."""
        for i, msg in enumerate(msgs):
            if len(held) >= self.settings.batch_groups:
                return msgs[i:]
            seq = msg.metadata.sequence.stream
            verdict = self.intake.judge(msg.data, msg.headers, seq, version)
            self.read_seq = max(self.read_seq, seq)
            if verdict.group is not None:
                held.append((verdict.group, msg))  # acknowledged once its step is applied
                continue
            await self._settle(msg, verdict, seq)
            if verdict.outcome != "duplicate":
                self.on_judged()
        return []

    async def applied(self) -> None:
        """The step training the held groups was applied: acknowledge their messages. If an ack is lost
        the message comes back after ack_wait and the intake skips it as a duplicate."""
        msgs = [m for _, m in self._held]
        self._held = []
        for msg in msgs:
            try:
                await msg.ack()
            except Exception as exc:
                if not retryable(exc):
                    raise
                log.warning("ack failed; the message will be redelivered", error=repr(exc))

    async def _settle(self, msg: Any, verdict: Verdict, seq: int) -> None:
        """Ack a judged message that is not trained, or terminate a malformed one (never redelivered,
        so it cannot stop a resume either). If that fails the message comes back after ack_wait and
        is judged again."""
        try:
            if verdict.outcome != "malformed":
                await msg.ack()
            elif verdict.cause == "malformed":
                await terminate_poison(msg, ValueError(verdict.error), self.metrics)
            else:  # it decodes: the sender is known
                log.error("invalid group terminated", cause=verdict.cause, prompt_id=verdict.prompt_id, worker=verdict.worker,
                          stream_seq=seq, error=verdict.error)
                await msg.term()
        except Exception as exc:
            if not retryable(exc):
                raise
            log.warning("ack failed; the message will be redelivered", error=repr(exc))
