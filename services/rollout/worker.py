"""The rollout worker loop: prompts in from the PROMPTS work queue, one trajectory message out per
prompt, the prompt acked only after the trajectory's publish was acknowledged.

Runs inside `jetrl rollout`, and in a test's event loop as is. Delivery rules (docs/design.md "Failure
semantics"):
- every worker of a run shares one durable pull consumer, so each prompt goes to one worker;
- while an episode runs, `in_progress()` keeps the prompt from being redelivered;
- a prompt whose `min_version` this worker's inference servers do not hold yet waits (in progress, no
  redelivery) until they do (`version_gate.py`): a group generated with older weights would be stale;
- the result carries `Nats-Msg-Id`, so a result published twice (a worker died between publish and
  ack) is dropped by JetStream;
- an episode that raises, or runs past `episode_timeout_s`, is `nak`ed with a delay and retried; at
  the consumer's `max_deliver`-th attempt (or at once for errors no retry can fix) a rejection marker
  carrying the error is published;
- a prompt that does not decode is terminated and counted; if its `Nats-Msg-Id` names its prompt id
  (as the trainer's feeder and `jetrl prompts` set it), a rejection marker is published for it first,
  so the feeder's accounting closes and the prompt is re-issued.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas.headers import prompt_id_of, prompt_tag_of, rejection_headers, trajectory_headers
from schemas.messages import MessageError, PromptTask, RejectionMarker, decode, encode
from schemas.subjects import PROMPTS_STREAM, TRAJECTORIES_STREAM, Subjects
from schemas.trajectory import TrajectoryError, encode_group_with_meta
from schemas.trajectory.warm import warm_up
from services.common.bus import Bus, publish_acked
from services.common.busretry import INITIAL_BACKOFF_S, MAX_BACKOFF_S, full_jitter
from services.common.consumers import add_consumer
from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher
from services.common.poison import terminate_poison
from services.rollout.dump import TrajectoryDumper
from services.rollout.engine import BadRequestError
from services.rollout.failures import EpisodeFailures, set_current
from services.rollout.puller import Puller
from services.rollout.stats import RolloutStats, constraint_counters
from services.rollout.tensors import group_sizes
from services.rollout.version_gate import VersionGate
from services.rollout.versions import workflow_name
from services.rollout.worker_config import WorkerConfig
from services.rollout.workflow import RolloutWorkflow, WorkflowError, as_tensor_dict, workflow_context

log = get_logger("rollout")

#: errors a retry of the same episode cannot fix: reject the prompt on the first attempt (an inference
#: 400 is the caller's bug, whether a built-in workflow converted it to WorkflowError or not)
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (WorkflowError, TrajectoryError, NotImplementedError, BadRequestError)


class EpisodeTimeout(TimeoutError):
    """An episode ran past `episode_timeout_s` (a failed attempt: retried, then rejected)."""


class RolloutWorker:
    def __init__(
        self,
        nc: NATS,
        run: str,
        workflow: RolloutWorkflow,
        engine: Any,
        config: WorkerConfig,
        *,
        metrics: MetricsPublisher | None = None,
        dumper: TrajectoryDumper | None = None,
        bus: Bus | None = None,
    ) -> None:
        self.nc = nc
        self.bus = bus if bus is not None else Bus()
        """The replicas and declare policy of the streams `declare` declares, the store alarm of its writes
        (the service's; None: a lone local server)."""
        self.js = nc.jetstream()
        self.subjects = Subjects(run)
        self.run_name = run
        self.workflow = workflow
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.dumper = dumper
        self.stats = RolloutStats()
        self.failures = EpisodeFailures(workflow_name(workflow), config.fail_fast_after)
        self._task_ids = itertools.count()  # AReaL's integer task ids, one per episode task
        self.max_deliver = config.max_deliver
        self.gate = VersionGate(engine, poll_s=config.version_poll_s, servable_poll_s=config.servable_poll_s)
        self._inflight: set[asyncio.Task[None]] = set()
        self._at_gate: set[asyncio.Task[None]] = set()
        """Episodes still waiting for their weight version: nothing generated yet."""
        self._wake: asyncio.Event | None = None

    # ---------------------------------------------------------------------------------- the consumer

    def consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.subjects.rollout_consumer,
            filter_subject=self.subjects.prompts_all,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            max_deliver=self.config.max_deliver,
            ack_wait=self.config.ack_wait_s,
            max_ack_pending=self.config.max_ack_pending,
        )

    async def declare(self) -> None:
        """Declare the streams and the shared consumer (idempotent: every worker does it). The
        consumer's own `max_deliver` is what counts, whichever worker declared it. A bus that does not
        answer yet (a cluster still electing) is waited out, for the consumer as for the streams."""
        await self.bus.declare_streams(self.js)
        info = await add_consumer(self.js, PROMPTS_STREAM, self.consumer_config(), policy=self.bus.retry)
        self.max_deliver = info.config.max_deliver or self.config.max_deliver

    # ---------------------------------------------------------------------------------- the loop

    async def run(self, stopping: asyncio.Event) -> None:
        """Pull and run episodes until `stopping` is set, then let in-flight episodes finish within
        `drain_timeout_s`; those still running are cancelled and their prompts `nak`ed."""
        await self.declare()
        if self.gate.enabled:
            await self.gate.follow_loads(self.nc, self.run_name)
            # No prompt is taken before a server can run it: a worker started beside its servers (as
            # compose, k8s and `jetrl up` start them) would otherwise fail its first episodes.
            # pyarrow's first conversion (pandas' import) meanwhile, not in the first episode's encode
            waited, _ = await asyncio.gather(self.gate.wait_servable(stopping), asyncio.to_thread(warm_up))
            if stopping.is_set():
                await self.gate.close()
                return
            log.info("inference servers serving", version=self.gate.version, waited_s=round(waited, 2))
        puller = Puller(self.nc, PROMPTS_STREAM, self.subjects.rollout_consumer, self.config.fetch_timeout_s)
        await puller.start()
        self._wake = puller.wake
        log.info("rollout worker pulling", consumer=self.subjects.rollout_consumer, max_deliver=self.max_deliver)
        stop_wait = asyncio.create_task(stopping.wait(), name="stop-wait")
        stop_wait.add_done_callback(lambda _: puller.wake.set())
        # ask again once a quarter of the slots are free: a request per several prompts, not per prompt
        min_batch = max(1, self.config.max_concurrent // 4)
        failures = 0  # consecutive failed pulls: the backoff grows as the bus stays away
        try:
            while not stopping.is_set():
                fatal = self.failures.fatal()
                if fatal is not None:  # every episode fails: stop, with the error, rather than burn prompts
                    raise fatal
                puller.wake.clear()
                while puller.arrived:
                    self._start(puller.arrived.popleft())
                error = puller.refused
                if error is None:
                    try:
                        await puller.top_up(self.config.max_concurrent - len(self._inflight), min_batch)
                    except nats.errors.Error as exc:  # reconnecting, server restarting: keep trying
                        error = repr(exc)
                if error is not None:
                    delay = full_jitter(failures, INITIAL_BACKOFF_S, MAX_BACKOFF_S)
                    failures += 1
                    log.warning("pull failed; retrying", error=error, attempt=failures, delay_s=round(delay, 2))
                    await asyncio.wait({stop_wait}, timeout=delay)
                    puller.refused = None
                    continue
                failures = 0
                deadline = puller.next_deadline()
                timeout = self.config.fetch_timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    await asyncio.wait_for(puller.wake.wait(), timeout=timeout)
                except TimeoutError:
                    pass
        finally:
            stop_wait.cancel()
            for msg in await puller.close():  # delivered, never started: straight to another worker
                await self._quiet(msg.nak())
            await self._drain()
            await self.gate.close()

    def _start(self, msg: Msg) -> None:
        task = asyncio.create_task(self.handle(msg), name=f"episode-{msg.metadata.sequence.stream}")
        self._inflight.add(task)
        self.stats.in_flight = len(self._inflight)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        if self._wake is not None:  # a slot is free: the loop may ask for more prompts
            self._wake.set()
        self.stats.in_flight = len(self._inflight)
        if not task.cancelled() and task.exception() is not None:
            # handle() catches episode errors; what reaches here is a bus failure (publish/ack): the
            # prompt was not acked, so JetStream redelivers it
            log.error("episode handling failed", error=repr(task.exception()))

    async def _drain(self) -> None:
        if not self._inflight:
            return
        # A prompt still waiting for its version has nothing to lose and may wait for a version no one
        # will make now (the trainer stops too): back to the queue at once, for another worker or the
        # next start, instead of holding the shutdown for `drain_timeout_s`.
        waiting = [t for t in self._at_gate if not t.done()]
        for task in waiting:
            task.cancel()
        log.info("draining in-flight episodes", count=len(self._inflight) - len(waiting), released_unstarted=len(waiting))
        _, still = await asyncio.wait(set(self._inflight), timeout=self.config.drain_timeout_s)
        for task in still:
            task.cancel()
        if still:
            await asyncio.wait(still, timeout=2.0)

    # ---------------------------------------------------------------------------------- one prompt

    async def handle(self, msg: Msg) -> None:
        try:
            task = decode(PromptTask, msg.data)
        except MessageError as exc:
            await self._poison(msg, exc)
            return
        is_eval = task.is_eval or msg.subject == self.subjects.prompts_eval
        heartbeat = asyncio.create_task(self._heartbeat(msg), name=f"in-progress-{task.prompt_id}")
        try:
            # held, in progress, until the servers can generate a group the trainer will accept
            me = asyncio.current_task()
            if me is not None:
                self._at_gate.add(me)
            try:
                await self.gate.wait(task.min_version, task.prompt_id)
            finally:
                self._at_gate.discard(me)
            await self._episode(msg, task, is_eval, time.monotonic())
        except asyncio.CancelledError:
            # shutting down mid-episode: hand the prompt straight to another worker
            await asyncio.shield(self._quiet(msg.nak()))
            raise
        except Exception as exc:  # the bus failed (publish timed out, connection lost): try again later
            log.warning("publishing the result failed; prompt retried later", prompt_id=task.prompt_id, error=repr(exc))
            await self._quiet(msg.nak(delay=self.config.nak_delay_s))
        finally:
            heartbeat.cancel()

    async def _poison(self, msg: Msg, exc: MessageError) -> None:
        """Terminate a prompt that does not decode. The feeder counts it in flight until a result
        arrives, so when its id can be recovered from the header a rejection marker is that result
        (if publishing it fails, the prompt is `nak`ed so the next attempt publishes it)."""
        prompt_id = self._prompt_id_of(msg)
        if prompt_id is not None:
            is_eval = msg.subject == self.subjects.prompts_eval
            reason = f"malformed prompt: {exc}"
            marker = RejectionMarker(run=self.run_name, prompt_id=prompt_id, worker=self.config.worker, reason=reason, is_eval=is_eval)
            try:
                await self._publish(self._subject(is_eval), encode(marker),
                                    rejection_headers(self.run_name, prompt_id, prompt_tag_of(msg.headers)))
            except Exception as pub_exc:  # the bus failed: retry the whole prompt later
                log.warning("publishing a malformed prompt's rejection failed; retried later", prompt_id=prompt_id, error=repr(pub_exc))
                await self._quiet(msg.nak(delay=self.config.nak_delay_s))
                return
        await terminate_poison(msg, exc, self.metrics)

    def _prompt_id_of(self, msg: Msg) -> str | None:
        """The prompt id in the prompt's headers, as the feeder publishes prompts (`schemas.headers`)."""
        return prompt_id_of(self.run_name, msg.headers)

    async def _episode(self, msg: Msg, task: PromptTask, is_eval: bool, started: float) -> None:
        set_current(self.failures)  # this episode's task: where a shrunk group is reported
        try:
            with workflow_context.set(is_eval=is_eval, task_id=next(self._task_ids), prompt_id=task.prompt_id):
                result = as_tensor_dict(await self._run_episode(task))
            encoded = None if result is None else self._encode(task, result, is_eval, prompt_tag_of(msg.headers))
        except Exception as exc:
            await self._failed(msg, task, is_eval, exc, started)
            return
        if result is None or encoded is None:
            await self._reject(msg, task, is_eval, "every sample was rejected by the workflow", started)
            return
        body, headers = encoded
        await self._publish(self._subject(is_eval), body, headers)
        if self.dumper is not None:
            await self.dumper.awrite(task.prompt_id, result, is_eval)
        await msg.ack()
        self.failures.succeeded()
        samples, tokens = group_sizes(result)
        self.stats.episode_done(time.monotonic() - started, samples, tokens, rejected=False)

    async def _run_episode(self, task: PromptTask) -> Any:
        """The workflow's episode, bounded by `episode_timeout_s`: a hanging workflow must not hold its
        prompt (heartbeats keep it from redelivery) and a concurrency slot forever."""
        limit = self.config.episode_timeout_s
        deadline = asyncio.timeout(limit if limit > 0 else None)
        try:
            async with deadline:
                return await self.workflow.arun_episode(self.engine, task.data)
        except TimeoutError:
            if deadline.expired():  # ours, not a TimeoutError the workflow raised itself
                raise EpisodeTimeout(f"episode ran longer than episode_timeout_s={limit:g}") from None
            raise

    def _encode(self, task: PromptTask, result: dict[str, Any], is_eval: bool, tag: str = "") -> tuple[bytes, dict[str, str]]:
        """`tag`: the prompt's, copied onto the result: the trainer trains only answers to prompts it
        (or a configured issuer) tagged; the worker holds no key and checks nothing."""
        data, meta = encode_group_with_meta(result, run=self.run_name, prompt_id=task.prompt_id, worker=self.config.worker,
                                            is_eval=is_eval, workflow=workflow_name(self.workflow))
        return data, trajectory_headers(meta, tag)

    async def _failed(self, msg: Msg, task: PromptTask, is_eval: bool, exc: Exception, started: float) -> None:
        attempt = msg.metadata.num_delivered or 1
        permanent = isinstance(exc, PERMANENT_ERRORS)
        final = permanent or attempt >= self.max_deliver
        self.failures.failed(exc, prompt_id=task.prompt_id, attempt=attempt, final=final)
        if self._wake is not None:  # the loop checks whether every episode fails
            self._wake.set()
        if final:
            if self.metrics is not None:
                self.metrics.count("dead_letters")
            reason = f"{type(exc).__name__}: {exc} (attempt {attempt} of {self.max_deliver})"
            await self._reject(msg, task, is_eval, reason, started)
            return
        if self.metrics is not None:
            self.metrics.count("episode_errors")
        await msg.nak(delay=self.config.nak_delay_s)

    async def _reject(self, msg: Msg, task: PromptTask, is_eval: bool, reason: str, started: float) -> None:
        marker = RejectionMarker(run=self.run_name, prompt_id=task.prompt_id, worker=self.config.worker, reason=reason, is_eval=is_eval)
        headers = rejection_headers(self.run_name, task.prompt_id, prompt_tag_of(msg.headers))
        await self._publish(self._subject(is_eval), encode(marker), headers)
        await msg.ack()
        self.stats.episode_done(time.monotonic() - started, 0, 0, rejected=True)

    def _subject(self, is_eval: bool) -> str:
        return self.subjects.trajectories_eval if is_eval else self.subjects.trajectories

    async def _publish(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        """Publish and wait for the stream's ack, bounded (`publish_acked`). A full store is logged at
        error level naming the stream and counted (`store_full`), then raised as the episode's failure."""
        try:
            ack = await publish_acked(self.js, subject, body, timeout_s=self.config.publish_timeout_s,
                                      headers=dict(headers), stream=TRAJECTORIES_STREAM)
        except (nats.js.errors.APIError, TimeoutError) as exc:
            if await self.bus.retry.alarm.write_failed(exc, TRAJECTORIES_STREAM, f"publish {subject}") and self.metrics is not None:
                self.metrics.count("store_full")
            raise
        if ack.duplicate:
            log.info("result already recorded (duplicate dropped)", subject=subject, msg_id=headers.get("Nats-Msg-Id"))

    async def _heartbeat(self, msg: Msg) -> None:
        period = max(self.config.ack_wait_s / 3, 0.05)
        while True:
            await asyncio.sleep(period)
            await self._quiet(msg.in_progress())

    @staticmethod
    async def _quiet(coro: Any) -> None:
        try:
            await coro
        except Exception as exc:  # the connection is going away; JetStream redelivers after ack_wait
            log.warning("ack-side message failed", error=repr(exc))

    # ---------------------------------------------------------------------------------- metrics

    async def metrics_loop(self, stopping: asyncio.Event, interval_s: float) -> None:
        if self.metrics is None:
            return
        # report at once, so `jetrl status` sees a new worker alive before its first interval ends
        await self.metrics.emit(self._snapshot())
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), timeout=interval_s)
            except TimeoutError:
                pass
            await self.metrics.emit(self._snapshot())

    def _snapshot(self) -> dict[str, float]:
        gate = {"version_waits": float(self.gate.waits), "version_wait_s": self.gate.waited_s}
        if self.gate.version is not None:
            gate["servers_version"] = float(self.gate.version)
        # the workflow's own statistics (AReaL's stats_tracker), means over the interval, by scope/key
        from services.rollout.compat import stats_tracker

        return {**self.stats.snapshot(), **gate, **self.failures.counters(), **constraint_counters(self.engine, self.workflow),
                **stats_tracker.export_all(reset=True)}
