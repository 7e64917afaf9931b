"""The prompt feeder, a part the trainer owns: its ledger (`ledger.py`: which row goes out next under
which id, the admission rule, what is in flight) and its side of the bus, whose subscriptions it opens
and closes itself. Prompts go out to the PROMPTS work queue under the admission rule, each counted as
issued only once its publish is acknowledged (a failed publish puts the row back); dead letters come
back in as rejections; every `feeder.eval_every` steps an eval round goes out (`evaluation.py` reads
its answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import secrets
from typing import Any, Protocol

from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from schemas.headers import prompt_headers
from schemas.messages import MessageError, PromptTask, decode, encode
from schemas.subjects import PROMPTS_STREAM, Subjects
from services.common.bus import publish_acked, unsubscribe_quietly
from services.common.busretry import BusUnavailable, RetryPolicy, with_retries
from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher
from services.trainer.feed.dataset import load_rows
from services.trainer.feed.evaluation import EvalRounds
from services.trainer.feed.ledger import PromptLedger
from services.trainer.settings import TrainerSettings
from services.trainer.versions import VersionWindow

log = get_logger("trainer")

PUBLISH_TIMEOUT_S = 5.0
STOP_GRACE_S = 2.0
"""At a stop, how long a round of prompts being published may still take before it is cancelled."""
"""One attempt of a prompt publish waits this long for the stream's acknowledgement."""


class Answers(Protocol):
    """What the feeder asks the side that judges the answers (the intake, `intake/intake.py`)."""

    def is_trained(self, prompt_id: str) -> bool:
        """Whether the group of `prompt_id` was already trained."""
        ...

    def tag_for(self, prompt_id: str) -> str:
        """The issuer tag a prompt carries (checked on its answer)."""
        ...


class Feeder:
    def __init__(self, settings: TrainerSettings, window: VersionWindow, answers: Answers, *, gate_versions: bool,
                 retry: RetryPolicy | None = None) -> None:
        """`window`: the trainer's version window (read only: the trainer moves it); `answers`: whether
        a prompt's group was trained and the tag a prompt carries; `gate_versions`: whether this trainer
        publishes weights (prompts wait for their weights only then: otherwise no server ever loads a
        newer version); `retry`: the trainer's retry policy (`Bus.retry`; None: a fresh one)."""
        self.settings = settings
        self.retry = retry if retry is not None else RetryPolicy()
        f = settings.feeder
        self.window = window
        self.ledger = PromptLedger(
            run=settings.run, rows=load_rows(f.dataset_path, f.dataset), batch_groups=settings.batch_groups, window=window,
            max_in_flight=f.max_in_flight, seed=settings.seed, epochs=f.epochs, shuffle=f.shuffle,
            eval_rows=load_rows(f.eval_dataset_path, f.eval_dataset) if f.eval_dataset_path else [],
            max_attempts=f.max_attempts, in_flight_timeout_s=f.in_flight_timeout_s, gate_versions=gate_versions,
        )
        self.subjects = Subjects(settings.run)
        self.answers = answers
        self.nonce = secrets.token_hex(3)
        """Tells this trainer process's prompts apart from earlier ones' (eval ids; training ids on a reused run)."""
        self.nc: NATS | None = None
        self.metrics: MetricsPublisher | None = None
        self.evals: EvalRounds | None = None
        """The eval rounds' answers (with `feeder.eval_every`), from `start` to `close`."""
        self._dead_letters: Any = None
        """The dead-letter advisory subscription, from `start` to `close`."""
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------------------ the bus

    async def start(self, nc: NATS, metrics: MetricsPublisher | None) -> None:
        """Open the feeder's subscriptions: dead-letter advisories, and eval answers if eval rounds are on."""
        self.nc, self.metrics = nc, metrics
        if self.settings.feeder.eval_every:
            self.evals = EvalRounds(nc, self.settings.run, self.settings.feeder.eval_timeout_s)
            await self.evals.start()
        await self._watch_dead_letters()

    async def evals_reported(self, stopping: asyncio.Event) -> None:
        """Until every eval round issued is reported (answered, or timed out after `feeder.eval_timeout_s`)
        or `stopping` is set: the round after a run's last step is read, not dropped."""
        if self.evals is not None:
            await self.evals.settled(stopping)

    async def close(self) -> None:
        """End the feeder's subscriptions (before the connection is drained)."""
        if self.evals is not None:
            await self.evals.close()
        sub, self._dead_letters = self._dead_letters, None
        await unsubscribe_quietly(sub, "dead-letter")

    def fresh_start(self) -> None:
        """The run name was used before: set this incarnation's prompt ids apart from the earlier ones'."""
        self.ledger.tag = self.nonce

    def resume_behind(self) -> None:
        """The trainer resumed behind the version it announced before it was killed and moved its version
        window (`PromptLedger.resume_behind`): this process's prompt ids are set apart from the killed one's."""
        self.ledger.resume_behind(self.nonce)

    def wake(self) -> None:
        """A slot may have freed (an answer was judged, a step applied): admit prompts now, not at the next tick."""
        self._wake.set()

    async def feed_once(self) -> int:
        """Time out unanswered prompts, then publish every prompt the admission rule allows now;
        returns how many. A publish that fails for good puts its row back and raises (once the
        others of the round are settled)."""
        if self.nc is None:
            return 0
        ledger = self.ledger
        ledger.expire()
        tasks: list[PromptTask] = []
        while (task := ledger.next_task(self.window.version)) is not None:
            if self.answers.is_trained(task.prompt_id):
                # re-issued after a resume, but its answer was already read from the recording
                ledger.on_accepted(task.prompt_id)
                continue
            tasks.append(task)
        await self._publish_all(self.nc.jetstream(), self.subjects.prompts_train, tasks, confirm=True)
        self._carry_counters()
        return len(tasks)

    async def _publish_all(self, js: Any, subject: str, tasks: list[PromptTask], *, confirm: bool) -> None:
        """Publish `tasks` pipelined: every publish is sent before any acknowledgement is awaited, so
        a round of prompts leaves in one socket write and one wake-up of the server instead of a round
        trip each (the stream keeps their order: the client writes them in the order they are made).
        `confirm`: each acknowledged training prompt is confirmed in the ledger; the failed ones (all
        unconfirmed ones if the round is cancelled) are put back, in their order. Raises the first
        failure once every publish has ended."""
        confirmed: set[str] = set()

        async def one(task: PromptTask) -> None:
            await self._publish_prompt(js, subject, task)
            if confirm:
                self.ledger.confirm(task.prompt_id)
                confirmed.add(task.prompt_id)

        try:
            results = await asyncio.gather(*(one(t) for t in tasks), return_exceptions=True)
        except BaseException:
            self._put_back([t for t in tasks if t.prompt_id not in confirmed] if confirm else [])
            raise
        failed = [(t, r) for t, r in zip(tasks, results, strict=True) if isinstance(r, BaseException)]
        if confirm:
            self._put_back([t for t, _ in failed])
        if failed:
            raise failed[0][1]

    def _put_back(self, tasks: list[PromptTask]) -> None:
        for task in reversed(tasks):  # each goes to the front of the line: reversed keeps their order
            self.ledger.put_back(task.prompt_id)

    async def feed_forever(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            round_ = asyncio.ensure_future(self.feed_once())
            stop = asyncio.ensure_future(stopping.wait())
            await asyncio.wait({round_, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not round_.done():  # a stop: a round waiting on a bus that is gone would wait out its retries
                await asyncio.wait({round_}, timeout=STOP_GRACE_S)
                round_.cancel()
                with contextlib.suppress(asyncio.CancelledError, BusUnavailable):
                    await round_
                return
            try:
                round_.result()
            except BusUnavailable as exc:  # the row is back in line; try again on the next round
                log.error("feeder cannot publish; will try again", error=str(exc))
            self._wake.clear()
            waiters = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(stopping.wait())]
            await asyncio.wait(waiters, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()

    async def issue_eval(self) -> None:
        """The eval round after the current step; one that cannot be published is logged and skipped."""
        assert self.nc is not None
        js = self.nc.jetstream()
        version = self.window.version
        tasks = self.ledger.eval_tasks(version, self.settings.feeder.eval_size, version, self.nonce)
        if self.evals is not None:
            self.evals.expect(version, [t.prompt_id for t in tasks])
        try:
            await self._publish_all(js, self.subjects.prompts_eval, tasks, confirm=False)
        except BusUnavailable as exc:  # not worth stopping training for: the round reports what came back
            log.error("eval prompts not published", step=version, error=str(exc))

    async def _publish_prompt(self, js: Any, subject: str, task: PromptTask) -> None:
        headers = prompt_headers(self.settings.run, task.prompt_id, self.answers.tag_for(task.prompt_id))
        body = encode(task)

        async def publish() -> Any:
            return await publish_acked(js, subject, body, timeout_s=PUBLISH_TIMEOUT_S, headers=headers, stream=PROMPTS_STREAM)

        ack = await with_retries(f"publish prompt {task.prompt_id}", publish, self.settings.bus_retry_timeout_s, policy=self.retry)
        if ack.duplicate:  # an earlier attempt got through; its acknowledgement was lost
            log.info("prompt already queued (duplicate dropped)", prompt_id=task.prompt_id)

    async def _watch_dead_letters(self) -> None:
        """A prompt that exhausted the rollout consumer's max_deliver is a dead letter: count it as
        rejected (so it is re-issued) and delete it, or it would sit in the work queue forever. The
        advisory comes once: reading the prompt it names waits out a bus that does not answer (a stream
        electing its leader) for `bus_retry_timeout_s`, or the row would stay in flight for good."""
        assert self.nc is not None
        js = self.nc.jetstream()
        subject = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{PROMPTS_STREAM}.{self.subjects.rollout_consumer}"
        budget = self.settings.bus_retry_timeout_s

        async def on_advisory(msg: Any) -> None:
            try:
                seq = int(json.loads(msg.data)["stream_seq"])
                stored = await with_retries(f"read dead letter {seq}", functools.partial(js.get_msg, PROMPTS_STREAM, seq), budget,
                                            policy=self.retry)
                task = decode(PromptTask, stored.data or b"")  # no payload: MessageError below
            except (MessageError, KeyError, ValueError, NotFoundError) as exc:
                log.warning("dead-letter advisory not usable", error=repr(exc))
                return
            except BusUnavailable as exc:
                log.error("dead letter not read: its prompt stays in flight until in_flight_timeout_s fails it", error=str(exc))
                return
            if self.metrics is not None:
                self.metrics.count("dead_letters")
            if not task.is_eval and self.ledger.on_rejected(task.prompt_id, "dead_letter"):
                self.wake()
            log.warning("prompt dead-lettered; treated as rejected", prompt_id=task.prompt_id, stream_seq=seq)
            try:
                await with_retries(f"delete dead letter {seq}", functools.partial(js.delete_msg, PROMPTS_STREAM, seq), budget,
                                   policy=self.retry)
            except NotFoundError:
                pass
            except BusUnavailable as exc:  # counted and re-issued; only the stream keeps a copy
                log.warning("dead letter not deleted", error=str(exc))

        self._dead_letters = await self.nc.subscribe(subject, cb=on_advisory)

    # ------------------------------------------------------------------------------ answers (from the intake)

    def owns(self, prompt_id: str) -> bool:
        return self.ledger.owns(prompt_id)

    def on_accepted(self, prompt_id: str) -> bool:
        return self.ledger.on_accepted(prompt_id)

    def on_rejected(self, prompt_id: str, cause: str = "rejected") -> bool:
        return self.ledger.on_rejected(prompt_id, cause)

    def on_stale(self, prompt_id: str) -> bool:
        return self.ledger.on_stale(prompt_id)

    def on_filtered(self, prompt_id: str) -> bool:
        return self.ledger.on_filtered(prompt_id)

    # ------------------------------------------------------------------------------ figures and state

    @property
    def exhausted(self) -> bool:
        """Nothing left to issue and nothing awaited: training can end."""
        return self.ledger.exhausted

    def metric_values(self) -> dict[str, float]:
        """The ledger's counters (`feeder_<name>`), the admission bound at this version and the epoch."""
        values = self.ledger.metric_values()
        values.update({"feeder_bound": float(self.ledger.bound(self.window.version)), "epoch": float(self.ledger.epoch)})
        return values

    def _carry_counters(self) -> None:
        """Carry the ledger's counters (re-issues, stale groups, dropped rows by cause) in every
        metrics event of the trainer, as monotonic counts: `jetrl status` and the run summary read them."""
        if self.metrics is not None:
            for key, value in self.ledger.metric_values().items():
                self.metrics.counters[key] = int(value)

    def state_dict(self) -> dict[str, Any]:
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ledger.load_state_dict(state)
