"""The feeder's side of the bus, a part of `Trainer`: prompts out to the PROMPTS work queue under the
admission rule, each counted as issued only once its publish is acknowledged (a failed publish puts
the row back), dead letters back in as rejections, and the eval rounds.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from schemas.headers import prompt_headers
from schemas.messages import MessageError, PromptTask, decode, encode
from schemas.subjects import PROMPTS_STREAM, Subjects
from services.common.bus import publish_acked
from services.common.busretry import BusUnavailable, with_retries
from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher
from services.trainer.evaluation import EvalRounds
from services.trainer.feeder import Feeder
from services.trainer.intake import Intake
from services.trainer.settings import TrainerSettings

log = get_logger("trainer")

PUBLISH_TIMEOUT_S = 5.0
"""One attempt of a prompt publish waits this long for the stream's acknowledgement."""


class Feeding:
    """Mixed into `Trainer`, which sets these attributes."""

    s: TrainerSettings
    feeder: Feeder | None
    intake: Intake
    nc: NATS | None
    publish: Any
    metrics: MetricsPublisher | None
    subjects: Subjects
    version: int
    nonce: str
    evals: EvalRounds | None
    _sub_dead: Any = None
    """The dead-letter advisory subscription (`watch_dead_letters`); ended by `close_feeding`."""
    _wake_feeder: asyncio.Event

    async def feed_once(self) -> int:
        """Time out unanswered prompts, then publish every prompt the admission rule allows now;
        returns how many. A publish that fails for good puts its row back and raises."""
        if self.feeder is None or self.nc is None:
            return 0
        self.feeder.expire()
        self._gate_versions()
        js, n = self.nc.jetstream(), 0
        while (task := self.feeder.next_task(self.version)) is not None:
            if task.prompt_id in self.intake.trained:
                # re-issued after a resume, but its answer was already read from the recording
                self.feeder.on_accepted(task.prompt_id)
                continue
            try:
                await self._publish_prompt(js, self.subjects.prompts_train, task)
            except BaseException:
                self.feeder.put_back(task.prompt_id)
                raise
            self.feeder.confirm(task.prompt_id)
            n += 1
        self._feeder_metrics()
        return n

    def _gate_versions(self) -> None:
        """Prompts wait for their weights only if this trainer publishes weights: otherwise no server
        will ever load a newer version."""
        assert self.feeder is not None
        self.feeder.gate_versions = self.publish is not None and self.s.publish_weights

    def _feeder_metrics(self) -> None:
        """Carry the feeder's counters (re-issues, stale groups, dropped rows by cause) in every
        metrics event of the trainer, as monotonic counts: `jetrl status` and the run summary read them."""
        if self.metrics is not None and self.feeder is not None:
            for key, value in self.feeder.metric_values().items():
                self.metrics.counters[key] = int(value)

    async def _publish_prompt(self, js: Any, subject: str, task: PromptTask) -> None:
        headers = prompt_headers(self.s.run, task.prompt_id, self.intake.tag_for(task.prompt_id))  # the intake checks it
        body = encode(task)

        async def publish() -> Any:
            return await publish_acked(js, subject, body, timeout_s=PUBLISH_TIMEOUT_S, headers=headers, stream=PROMPTS_STREAM)

        ack = await with_retries(f"publish prompt {task.prompt_id}", publish, self.s.bus_retry_timeout_s)
        if ack.duplicate:  # an earlier attempt got through; its acknowledgement was lost
            log.info("prompt already queued (duplicate dropped)", prompt_id=task.prompt_id)

    async def feed_forever(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                await self.feed_once()
            except BusUnavailable as exc:  # the row is back in line; try again on the next round
                log.error("feeder cannot publish; will try again", error=str(exc))
            self._wake_feeder.clear()
            waiters = [asyncio.ensure_future(self._wake_feeder.wait()), asyncio.ensure_future(stopping.wait())]
            await asyncio.wait(waiters, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()

    async def watch_dead_letters(self) -> None:
        """A prompt that exhausted the rollout consumer's max_deliver is a dead letter: count it as
        rejected (so it is re-issued) and delete it, or it would sit in the work queue forever."""
        assert self.nc is not None
        js = self.nc.jetstream()
        subject = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{PROMPTS_STREAM}.{self.subjects.rollout_consumer}"

        async def on_advisory(msg: Any) -> None:
            try:
                seq = int(json.loads(msg.data)["stream_seq"])
                stored = await js.get_msg(PROMPTS_STREAM, seq)
                task = decode(PromptTask, stored.data or b"")  # no payload: MessageError below
            except (MessageError, KeyError, ValueError, NotFoundError) as exc:
                log.warning("dead-letter advisory not usable", error=repr(exc))
                return
            if self.metrics is not None:
                self.metrics.count("dead_letters")
            if not task.is_eval and self.feeder is not None and self.feeder.on_rejected(task.prompt_id, "dead_letter"):
                self._wake_feeder.set()
            log.warning("prompt dead-lettered; treated as rejected", prompt_id=task.prompt_id, stream_seq=seq)
            try:
                await js.delete_msg(PROMPTS_STREAM, seq)
            except NotFoundError:
                pass

        self._sub_dead = await self.nc.subscribe(subject, cb=on_advisory)

    async def close_feeding(self) -> None:
        """End the dead-letter subscription (before the connection is drained)."""
        sub, self._sub_dead = self._sub_dead, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the bus may be gone; shutting down matters more
                log.warning("dead-letter unsubscribe failed", error=repr(exc))

    async def _issue_eval(self) -> None:
        assert self.feeder is not None and self.nc is not None
        js = self.nc.jetstream()
        self._gate_versions()
        tasks = self.feeder.eval_tasks(self.version, self.s.feeder.eval_size, self.version, self.nonce)
        if self.evals is not None:
            self.evals.expect(self.version, [t.prompt_id for t in tasks])
        try:
            for task in tasks:
                await self._publish_prompt(js, self.subjects.prompts_eval, task)
        except BusUnavailable as exc:  # not worth stopping training for: the round reports what came back
            log.error("eval prompts not published", step=self.version, error=str(exc))

