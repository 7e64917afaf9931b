"""`Trainer`: rank 0's training loop, drivable in-process (tests) or as the service.

One step: gather B accepted groups from TRAJECTORIES (rejections, stale, zero-variance, duplicate and
malformed messages are counted and handled on the way), collate and compute advantages, scatter each
rank's share, run the algorithm's update (default: decoupled PPO) on every rank, version += 1, gather and publish the
weights, emit metrics, checkpoint every K steps. The feeder publishes prompts concurrently.

Consumption is transactional: an accepted group is held, its message unacknowledged, until the step
that trains it is applied; only then are its prompt id `trained`, its message acknowledged and
`last_seq` moved past everything read for the step. A stop or a bus loss mid-collect therefore leaves
`last_seq` at the last trained step: a checkpoint taken then makes a resume read the held groups again
and train them, once.

NATS calls are retried through a server restart (`busretry`); if the bus stays away longer than
`bus_retry_timeout_s`, `run` checkpoints and raises `BusUnavailable`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from schemas.subjects import TRAJECTORIES_STREAM, Subjects
from services.common.bus import declare_streams
from services.common.busretry import Backoff, BusUnavailable, retryable, with_retries
from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher
from services.common.poison import terminate_poison
from services.trainer import checkpoint as ckpt
from services.trainer.actor import PPOActor
from services.trainer.batch import collate, shard
from services.trainer.collective import Command, execute, scatter
from services.trainer.dataset import load_rows
from services.trainer.engine import TrainEngine
from services.trainer.evaluation import EvalRounds
from services.trainer.feeder import Feeder
from services.trainer.feeding import Feeding
from services.trainer.fresh import clear_leftovers
from services.trainer.intake import Group, Intake, Verdict, trust_prompts
from services.trainer.settings import TrainerSettings
from services.trainer.step_metrics import step_values
from services.trainer.validate import model_limits

log = get_logger("trainer")

Publish = Callable[[int, int, Path], Awaitable[Any]]
"""`publish(version, step, hf_dir)`: e.g. `WeightPublisher.publish_dir` with `consume=True`. The
trainer writes a fresh `hf_dir` per version and removes whatever is left of it afterwards, so the
publisher may take it over."""


class Trainer(Feeding):
    def __init__(self, settings: TrainerSettings, engine: TrainEngine, *, publish: Publish | None = None,
                 source: Any = None, broadcast: Any = None) -> None:
        self.s = settings
        # A group source (`jetrl replay`: `collect(trainer, stopping) -> list[Group] | None`) replaces
        # the durable consumer: same steps, different origin of the groups.
        self.source = source
        self.engine = engine
        self.actor = PPOActor(engine, settings.ppo)
        self.subjects = Subjects(settings.run)
        self.publish = publish
        self.broadcast = broadcast
        """A `BroadcastPublisher`: weights go to the servers in memory; `publish` is then not used."""
        self.version = 0
        self.last_seq = 0
        self.resumed = False
        self.nonce = secrets.token_hex(3)
        """Tells this trainer process's prompts apart from earlier ones' (eval ids; training ids on a reused run)."""
        self.feeder: Feeder | None = None
        if settings.feeder.enabled:
            f = settings.feeder
            self.feeder = Feeder(
                run=settings.run, rows=load_rows(f.dataset_path, f.dataset), batch_groups=settings.batch_groups, eta=settings.eta,
                max_in_flight=f.max_in_flight, seed=settings.seed, epochs=f.epochs, shuffle=f.shuffle,
                eval_rows=load_rows(f.eval_dataset_path, f.eval_dataset) if f.eval_dataset_path else [],
                max_attempts=f.max_attempts, in_flight_timeout_s=f.in_flight_timeout_s,
            )
        self.intake = Intake(settings.eta, settings.ppo.dynamic_filtering, self.feeder,
                             limits=model_limits(settings.model_path, settings.max_seq_len))
        trust_prompts(self.intake, settings, live=source is None)
        self._held: list[tuple[Group, Any]] = []
        """Accepted groups of the step being collected, each with its unacknowledged message (None
        from a group source): a collect cut short by a stop keeps them for the next one."""
        self._read_seq = 0
        """Highest stream sequence judged so far; `last_seq` catches up with it when a step is applied."""
        self._unjudged: list[Any] = []
        """Messages delivered beyond the batch being collected (not judged, not acked): the next step's first."""
        self.out = Path(settings.output_dir)
        self.nc: NATS | None = None
        self.metrics: MetricsPublisher | None = None
        self._wake_feeder = asyncio.Event()
        self._sub: Any = None
        self.evals: EvalRounds | None = None

    # ------------------------------------------------------------------------------ start

    async def start(self, nc: NATS) -> None:
        """Declare streams, restore the latest checkpoint if asked, position the consumer after its sequence."""
        self.nc = nc
        self.metrics = MetricsPublisher(nc, self.s.run, "trainer")
        js = nc.jetstream()
        await declare_streams(js)
        self.out.mkdir(parents=True, exist_ok=True)
        found = ckpt.resolve_resume(self.s.resume, self.s.output_dir)
        if found is not None:
            root, tag = found
            res = await asyncio.to_thread(
                execute, self.engine, self.actor, scatter(self._all(Command("load", directory=str(root), tag=tag)))
            )
            self._restore(res.client_state)
            self.resumed = True
            log.info("resumed", checkpoint=str(root / tag), version=self.version, last_seq=self.last_seq)
        elif self.feeder is not None and self.source is None:
            await self._start_afresh(js)
        self._record({"event": "start", "version": self.version, "last_seq": self.last_seq, "resumed": found is not None})
        if self.source is None:
            await self._open_consumer(js)
            if self.feeder is not None and self.s.feeder.eval_every:
                self.evals = EvalRounds(nc, self.s.run, self.s.feeder.eval_timeout_s)
                await self.evals.start()

    async def _start_afresh(self, js: Any) -> None:
        """No checkpoint, a feeder: the run starts now (`fresh.py`). The consumer starts after the
        stream's current end and is created before the first prompt is issued, so no answer to one of
        ours can be missed."""
        assert self.feeder is not None
        left = await clear_leftovers(js, self.subjects)
        self.last_seq = left.start_seq
        if left.used_before:
            self.feeder.tag = self.nonce

    async def _open_consumer(self, js: Any) -> None:
        # The checkpoint, not the server, is the truth about what was trained: recreate the durable so
        # it delivers right after the checkpoint's sequence (messages acked after it are trained again).
        # Without a checkpoint: every recorded trajectory (offline, no feeder), or after the stream's end
        # at a fresh start with a feeder (`last_seq` set by `_start_afresh`).
        name = self.subjects.trainer_consumer
        try:
            await js.delete_consumer(TRAJECTORIES_STREAM, name)
        except NotFoundError:
            pass
        cfg = ConsumerConfig(
            durable_name=name, ack_policy=AckPolicy.EXPLICIT, filter_subject=self.subjects.trajectories,
            ack_wait=300.0, max_ack_pending=-1,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if self.last_seq else DeliverPolicy.ALL,
            opt_start_seq=self.last_seq + 1 if self.last_seq else None,
        )
        await js.add_consumer(TRAJECTORIES_STREAM, cfg)
        self._sub = await js.pull_subscribe_bind(name, stream=TRAJECTORIES_STREAM)

    def _all(self, cmd: Command) -> list[Command]:
        return [cmd] * self.engine.world_size

    # ------------------------------------------------------------------------------ consuming

    async def collect(self, stopping: asyncio.Event | None = None) -> list[Group] | None:
        """Pull until B groups are accepted; None if stopping first (the groups accepted so far stay
        held, untrained and unacknowledged: see the module doc)."""
        held = self._held
        backoff = Backoff("fetch trajectories", self.s.bus_retry_timeout_s)
        while len(held) < self.s.batch_groups:
            if stopping is not None and stopping.is_set():
                return None
            if self._unjudged:  # delivered beyond the last step's batch: judged now, at this version
                msgs, self._unjudged = self._unjudged, []
                self._unjudged = await self._judge_into(held, msgs)
                continue
            try:
                # Never pull more than the step needs: later groups must be judged at a later version.
                msgs = await self._sub.fetch(min(self.s.fetch_batch, self.s.batch_groups - len(held)), timeout=self.s.fetch_timeout_s)
            except TimeoutError as exc:
                if self.nc is not None and not self.nc.is_connected:
                    # The server is away and the pull request waits: that counts towards giving up.
                    await backoff.failed(exc)
                else:  # nothing arrived
                    backoff.reset()
                continue
            except Exception as exc:
                if not retryable(exc):
                    raise
                await backoff.failed(exc)
                continue
            backoff.reset()
            self._unjudged = await self._judge_into(held, msgs)
        return [g for g, _ in held]

    async def _judge_into(self, held: list[tuple[Group, Any]], msgs: list[Any]) -> list[Any]:
        """Judge messages in order until the batch is full; returns the rest, unjudged. More can come
        than was asked for: pull requests made before a reconnect are answered after it."""
        for i, msg in enumerate(msgs):
            if len(held) >= self.s.batch_groups:
                return msgs[i:]
            seq = msg.metadata.sequence.stream
            verdict = self.intake.judge(msg.data, msg.headers, seq, self.version)
            self._read_seq = max(self._read_seq, seq)
            if verdict.group is not None:
                held.append((verdict.group, msg))  # acknowledged once its step is applied
                continue
            await self._settle(msg, verdict, seq)
            if verdict.outcome != "duplicate":
                self._wake_feeder.set()
        return []

    def _commit(self, groups: list[Group]) -> list[Any]:
        """The step training `groups` was applied: they are trained and `last_seq` covers every
        message read for it. Returns the held messages to acknowledge."""
        self.intake.commit([g.prompt_id for g in groups])
        self.last_seq = max(self.last_seq, self._read_seq)
        msgs = [m for _, m in self._held if m is not None]
        self._held = []
        return msgs

    async def _ack(self, msg: Any) -> None:
        """If the ack is lost the message comes back after ack_wait and the intake skips it as a duplicate."""
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

    # ------------------------------------------------------------------------------ the steps

    async def run(self, stopping: asyncio.Event) -> None:
        """Step until done or `stopping`, then checkpoint. If NATS stays away past
        `bus_retry_timeout_s`, checkpoint the steps trained since the last one, then raise `BusUnavailable`."""
        saved_at = self.version
        try:
            while not stopping.is_set() and not self.done:
                if await self.step(stopping) is not None and self.s.checkpoint_every:
                    if self.version % self.s.checkpoint_every == 0:
                        saved_at = self.version
        except BusUnavailable as exc:
            if self.version != saved_at:
                log.error("NATS unavailable; checkpointing before exiting", version=self.version, error=str(exc))
                await self.checkpoint()
            raise
        if self.version != saved_at or self.done:
            await self.checkpoint()
        log.info("training finished" if self.done else "stopped; checkpoint saved", version=self.version)

    async def step(self, stopping: asyncio.Event | None = None) -> dict[str, float] | None:
        """Collect, train, publish, report, maybe checkpoint. None if stopping before a full batch."""
        t0 = time.monotonic()
        before = Counter(self.intake.counts)
        groups = await (self.source.collect(self, stopping) if self.source is not None else self.collect(stopping))
        if groups is None:
            return None
        t_data = time.monotonic()
        # In a thread: with ppo.kl_in=reward the advantages need a reference forward pass.
        batch = await asyncio.to_thread(self.actor.compute_advantages, collate([g.tensors for g in groups]))
        pieces = shard(batch, self.engine.world_size, self.s.ppo.n_minibatches)
        bcast = self.broadcast if self.s.publish_weights else None
        to_disk = self.publish is not None if bcast is None else bcast.wants_disk(self.version + 1)
        weights_dir = str(self.out / "weights" / f"v{self.version + 1}") if to_disk and self.s.publish_weights else None
        cmds = [Command("train", pieces=p, weights_dir=weights_dir, weights_state=bcast is not None) for p in pieces]
        res = await asyncio.to_thread(lambda: execute(self.engine, self.actor, scatter(cmds)))
        applied = self._commit(groups)
        self.version += 1
        for msg in applied:
            await self._ack(msg)
        self._wake_feeder.set()
        t_train = time.monotonic()
        if bcast is not None and res.state is not None:
            try:
                await bcast.publish(self.version, res.state, res.weights_dir)
            finally:
                if res.weights_dir is not None:
                    _remove(res.weights_dir)
        elif res.weights_dir is not None and self.publish is not None:
            try:
                await self._publish_weights(res.weights_dir)
            finally:
                _remove(res.weights_dir)
        t_end = time.monotonic()
        values = step_values(self, batch, groups, res.stats, before, (t0, t_data, t_train, t_end))
        self._record({"version": self.version, "prompt_ids": [g.prompt_id for g in groups],
                      "seqs": [g.seq for g in groups], "last_seq": self.last_seq})
        if self.metrics is not None:
            await self.metrics.emit(values, step=self.version, version=self.version)
        log.info("step", version=self.version, loss=round(values["loss"], 4), reward=round(values["reward_mean"], 4))
        if self.s.checkpoint_every and self.version % self.s.checkpoint_every == 0:
            await self.checkpoint()
        if self.feeder is not None and self.s.feeder.eval_every and self.version % self.s.feeder.eval_every == 0:
            await self._issue_eval()
        return values

    async def _publish_weights(self, weights_dir: Path) -> None:
        publish, version = self.publish, self.version
        assert publish is not None
        taken = False

        async def attempt() -> Any:
            nonlocal taken
            if not await asyncio.to_thread(Path(weights_dir).is_dir):
                taken = True
                return None
            return await publish(version, version, weights_dir)

        await with_retries(f"publish weights v{version}", attempt, self.s.bus_retry_timeout_s)
        if taken:
            # A shared directory on our filesystem: the failed attempt moved the weights there before
            # its announcement failed, so this version cannot be published again. Skipping it costs
            # the servers one version; exiting would stop the run over a bus that is merely away.
            log.warning("weights version not announced; the next step publishes the next one", version=version)
            if self.metrics is not None:
                self.metrics.count("weights_versions_skipped")

    # ------------------------------------------------------------------------------ checkpoints

    async def checkpoint(self) -> Path:
        root = ckpt.checkpoint_root(self.s.output_dir)
        tag = ckpt.tag_for(self.version)
        state = {
            "jetrl_version": self.version, "jetrl_last_seq": self.last_seq,
            "jetrl_feeder": self.feeder.state_dict() if self.feeder else None,
            "jetrl_intake": self.intake.state_dict(), "jetrl_rng": ckpt.rng_state(),
        }
        await asyncio.to_thread(
            lambda: execute(
                self.engine,
                self.actor,
                scatter(self._all(Command("save", directory=str(root), tag=tag, client_state=state))),
            )
        )
        ckpt.prune(root, self.s.keep_checkpoints)
        self._record({"event": "checkpoint", "version": self.version, "last_seq": self.last_seq, "tag": tag})
        log.info("checkpoint saved", tag=tag, version=self.version, last_seq=self.last_seq)
        return root / tag

    def _restore(self, state: dict[str, Any]) -> None:
        self.version = int(state["jetrl_version"])
        self.last_seq = int(state["jetrl_last_seq"])
        if self.feeder is not None and state.get("jetrl_feeder"):
            self.feeder.load_state_dict(state["jetrl_feeder"])
        self.intake.load_state_dict(state["jetrl_intake"])
        ckpt.set_rng_state(state["jetrl_rng"])

    def _record(self, row: dict[str, Any]) -> None:
        if self.s.record_steps:
            with (self.out / "steps.jsonl").open("a") as f:
                f.write(json.dumps({"time": time.time(), **row}) + "\n")

    async def close(self) -> None:
        """Stop reading trajectories and eval answers, before the connection is drained: a pull
        request's late status left in the subscription's queue would hold the drain to its timeout.
        Nothing unacked is lost; JetStream redelivers it."""
        await self.close_feeding()
        if self.evals is not None:
            await self.evals.close()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # the bus may be gone; shutting down matters more
                log.warning("trajectory unsubscribe failed", error=repr(exc))
            self._sub = None

    async def stop_followers(self) -> None:
        """Release the other ranks (they exit after this)."""
        if self.engine.world_size > 1:
            await asyncio.to_thread(lambda: scatter(self._all(Command("stop"))))

    @property
    def done(self) -> bool:
        if self.s.total_steps and self.version >= self.s.total_steps:
            return True
        return self.feeder is not None and self.feeder.exhausted


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
