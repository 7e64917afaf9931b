"""`Trainer`: rank 0's training loop, drivable in-process (tests) or as the service.

One step: collect B accepted groups from a group source (`intake/source.py`: TRAJECTORIES through
`intake/consumer.py`, or a recording in a replay), collate and compute advantages, scatter each rank's share, run the algorithm's update
(default: decoupled PPO) on every rank, version += 1, acknowledge the step's messages, gather and
publish the weights, emit metrics, checkpoint every K steps. The feeder (`feed/feeder.py`), a part the
trainer owns, publishes prompts concurrently. The trainer alone moves its version window
(`versions.py`), which the intake and the feeder read.

Only once a step is applied are its prompt ids `trained` and `last_seq` moved past everything read for
it (transactional consumption: see `intake/consumer.py`).

NATS calls are retried through a server restart (`busretry`); if the bus stays away longer than
`bus_retry_timeout_s`, `run` checkpoints and raises `BusUnavailable`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from schemas.metric_names import REWARD_MEAN
from schemas.subjects import Subjects
from services.common.bus import Bus
from services.common.busretry import BusUnavailable
from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher
from services.trainer.feed import fresh
from services.trainer.feed.feeder import Feeder
from services.trainer.intake.batch import collate, shard
from services.trainer.intake.consumer import TrajectoryConsumer
from services.trainer.intake.intake import Intake, trust_prompts
from services.trainer.intake.source import Collected, GroupSource
from services.trainer.intake.validate import model_limits
from services.trainer.model import checkpoint as ckpt
from services.trainer.model.actor import PPOActor
from services.trainer.model.collective import Command, execute, scatter
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from services.trainer.step_metrics import StepFacts, step_values
from services.trainer.versions import VersionWindow
from services.weights.sender.sync import NoWeights, WeightSync

log = get_logger("trainer")
_LOGGED = ("weights_gather_s", "trim_s", "heap_free_mib", "resident_anon_gib", "resident_file_gib", "resident_shmem_gib")
"""Stats of the training call that each step's log line carries beside loss and reward (where memory and time go)."""

SourceFactory = Callable[[Intake], GroupSource]
"""Makes the group source that replaces the durable consumer (`jetrl replay`: a recording), given the
trainer's intake, through which it judges every message."""


class Trainer:
    def __init__(self, settings: TrainerSettings, engine: TrainEngine | None, *, weights: WeightSync | None = None,
                 source: SourceFactory | None = None, window: VersionWindow | None = None, bus: Bus | None = None) -> None:
        """`engine` None: built meanwhile (`jetrl trainer` starts the feeder and the consumer during
        DeepSpeed's init on a fresh start); `attach_engine` before the first step. `source`: groups from
        elsewhere than the durable consumer (`jetrl replay`), same steps. `window`: the version window
        (default: from `settings.eta`; a replay turns staleness off with its own). `bus`: the service's
        (its replicas, declare policy and retry policy; default: from the settings)."""
        self.settings = settings
        self.bus = bus if bus is not None else Bus.of(settings)
        self.live = source is None
        """Groups come from the run's TRAJECTORIES (not a recording): the versions on them are ours."""
        self.window = window or VersionWindow(settings.eta)
        self._engine: TrainEngine | None = None
        self._actor: PPOActor | None = None
        if engine is not None:
            self.attach_engine(engine)
        self.subjects = Subjects(settings.run)
        self.weights: WeightSync = weights if weights is not None else NoWeights()
        """How each version reaches the servers (`make_weight_sync`; none: nothing is published)."""
        self.last_seq = 0
        """The stream sequence every trained group's message is at or before (checkpointed)."""
        self.resumed = False
        self.intake = Intake(self.window, settings.ppo.dynamic_filtering, own_versions=self.live,
                             limits=replace(model_limits(settings.model_path, settings.max_seq_len),
                                            max_abs_reward=settings.max_abs_reward, min_logprob=settings.min_logprob))
        trust_prompts(self.intake, settings, live=self.live)
        self.feeder: Feeder | None = None
        if settings.feeder.enabled:
            self.feeder = Feeder(settings, self.window, self.intake, gate_versions=self.weights.publishes, retry=self.bus.retry)
            self.intake.feeder = self.feeder  # the intake tells the feeder what became of each prompt
        self.source: GroupSource = (TrajectoryConsumer(settings, self.intake, on_judged=self._wake_feeder, retry=self.bus.retry)
                                    if source is None else source(self.intake))
        self.out = Path(settings.output_dir)
        self.nc: NATS | None = None
        self.metrics: MetricsPublisher | None = None

    def attach_engine(self, engine: TrainEngine) -> None:
        self._engine = engine
        self._actor = PPOActor(engine, self.settings.ppo)

    @property
    def version(self) -> int:
        """The trainer's weight version now (its version window's)."""
        return self.window.version

    @property
    def engine(self) -> TrainEngine:
        if self._engine is None:
            raise RuntimeError("the trainer's engine is not built yet: attach_engine() first")
        return self._engine

    @property
    def actor(self) -> PPOActor:
        if self._actor is None:
            raise RuntimeError("the trainer's engine is not built yet: attach_engine() first")
        return self._actor

    async def start(self, nc: NATS) -> None:
        """Declare streams, restore the latest checkpoint if asked, position the consumer after its
        sequence, open the feeder's subscriptions."""
        self.nc = nc
        self.metrics = MetricsPublisher(nc, self.settings.run, "trainer")
        js = nc.jetstream()
        await self.bus.declare_streams(js)  # the service's replicas and declare policy
        self.out.mkdir(parents=True, exist_ok=True)
        found = ckpt.resolve_resume(self.settings.resume, self.settings.output_dir)
        if found is not None:  # (the engine is needed: `jetrl trainer` builds it first when resuming)
            root, tag = found
            res = await asyncio.to_thread(
                execute, self.engine, self.actor, scatter(self._all(Command("load", directory=str(root), tag=tag)))
            )
            self._restore(res.client_state)
            self.resumed = True
            log.info("resumed", checkpoint=str(root / tag), version=self.version, last_seq=self.last_seq)
        elif self.feeder is not None and self.live:
            await self._start_afresh(js)
        self._record({"event": "start", "version": self.version, "last_seq": self.last_seq, "resumed": found is not None})
        if found is not None and self.live:
            await self._catch_up(js)
        await self.source.open(nc, self.metrics, self.last_seq)
        if self.feeder is not None:  # after the consumer: no answer to one of its prompts can be missed
            await self.feeder.start(nc, self.metrics)
            if found is None and self.settings.feeder.eval_every and self.settings.feeder.eval_at_start:
                await self.feeder.issue_eval()  # the baseline round, before any training

    async def _start_afresh(self, js: Any) -> None:
        """No checkpoint, a feeder: the run starts now (`fresh.py`). The consumer starts after the
        stream's current end and is created before the first prompt is issued, so no answer to one of
        ours can be missed."""
        assert self.feeder is not None
        left = await fresh.clear_leftovers(js, self.subjects, self.bus.retry)
        self.last_seq = left.start_seq
        if left.used_before:
            self.feeder.fresh_start()
        if left.weights_version is not None:
            await self._continue_versions(left)

    async def _continue_versions(self, left: fresh.Leftovers) -> None:
        """An earlier trainer of the run announced version N, which the inference servers serve (a server
        started later loads it too). Starting at 0 would train nothing: every group would carry a version
        newer than the trainer. So this run's base weights are published as N+1 (on the disk path: every
        server loads them), and its versions count from there (`fresh.py`)."""
        assert self.feeder is not None
        first = left.first_version
        if not first or not self.weights.publishes:
            fresh.warn_served(left, self.settings.run)
            return
        fresh.log_continued(left, self.settings.run)
        staged = await asyncio.to_thread(fresh.stage_base_weights, self.settings.model_path, self.out / "weights" / f"v{first}")
        try:
            await self.weights.publish_dir(first, 0, staged)
        finally:
            await asyncio.to_thread(_remove, staged)
        self.window.continue_from(first)

    async def _catch_up(self, js: Any) -> None:
        """Resumed from version C while the run's last announced version is N > C: the trainer was killed
        after publishing N, before checkpointing it. The servers serve N, and versions C+1..N are weights
        nobody has any more: counting on from C would announce those numbers again with other weights (a
        server holding the number keeps what it holds) and train groups generated with the lost ones as
        if they were ours. So the restored weights are published as N+1, the version window's version and
        `first_version` move by N+1-C (the step count and `total_steps` go on from the checkpoint's), and
        what the killed incarnation's prompts produce is set apart (`fresh.py`)."""
        announced = await fresh.announced_version(js, self.subjects, self.bus.retry)
        if announced is None or announced <= self.version:
            return  # a clean restart (SIGTERM checkpoints what it announced), or behind us: the next step publishes past it
        restored, version = self.version, announced + 1
        if not self.weights.publishes:
            fresh.warn_behind(self.settings.run, restored, announced)
            return
        # the killed incarnation's feeder's prompts: answers to them would be foreign (pushed prompts stay
        # without a feeder: nothing would issue them again)
        dropped = await fresh.purge_prompts(js, self.subjects, self.bus.retry) if self.feeder is not None else 0
        fresh.log_caught_up(self.settings.run, restored, announced, dropped)
        cmd = Command("weights", weights_dir=str(self.out / "weights" / f"v{version}"))
        res = await asyncio.to_thread(execute, self.engine, self.actor, scatter(self._all(cmd)))
        assert res.weights_dir is not None
        try:
            await self.weights.publish_dir(version, restored - self.window.first_version, res.weights_dir)
        finally:
            await asyncio.to_thread(_remove, res.weights_dir)
        self.window.resume_behind(version)
        if self.feeder is not None:
            self.feeder.resume_behind()
        self._record({"event": "versions_continued", "checkpoint_version": restored, "announced_version": announced,
                      "version": version, "first_version": self.window.first_version})

    def _all(self, cmd: Command) -> list[Command]:
        return [cmd] * self.engine.world_size

    def _wake_feeder(self) -> None:
        if self.feeder is not None:
            self.feeder.wake()

    # ------------------------------------------------------------------------------ the steps

    async def run(self, stopping: asyncio.Event, on_step: Callable[[dict[str, float]], None] | None = None) -> None:
        """Step until done (`total_steps`, the feeder's dataset or the source exhausted) or `stopping`,
        then checkpoint; `on_step(values)` after each step. If NATS stays away past
        `bus_retry_timeout_s`, checkpoint the steps trained since the last one, then raise `BusUnavailable`."""
        saved_at = self.version
        try:
            while not stopping.is_set() and not self.done:
                values = await self.step(stopping)
                if values is not None and on_step is not None:
                    on_step(values)
                if values is not None and self.settings.checkpoint_every:
                    if self.version % self.settings.checkpoint_every == 0:
                        saved_at = self.version
        except BusUnavailable as exc:
            if not stopping.is_set():
                if self.version != saved_at:
                    log.error("NATS unavailable; checkpointing before exiting", version=self.version, error=str(exc))
                    await self.checkpoint()
                raise
            # a stop while the bus is gone: no retry can succeed now; the checkpoint below still can
            log.warning("stopping with NATS unavailable", version=self.version, error=str(exc))
        if self.version != saved_at or self.done:
            await self.checkpoint()
        if self.done and self.feeder is not None:  # e.g. total_steps a multiple of eval_every: the last round is read
            await self.feeder.evals_reported(stopping)
        log.info("training finished" if self.done else "stopped; checkpoint saved", version=self.version)

    async def step(self, stopping: asyncio.Event | None = None) -> dict[str, float] | None:
        """Collect, train, publish, report, maybe checkpoint. None if stopping before a full batch."""
        t0 = time.monotonic()
        before = Counter(self.intake.counts)
        collected = await self.source.collect(self.version, stopping)
        if collected is None:
            return None
        groups = collected.groups
        t_data = time.monotonic()
        # In a thread: with ppo.kl_in=reward the advantages need a reference forward pass.
        batch = await asyncio.to_thread(self.actor.compute_advantages, collate([g.tensors for g in groups]))
        pieces = shard(batch, self.engine.world_size, self.settings.ppo.n_minibatches)
        # What the training call produces for the weights (a checkpoint dir, the state, or the buckets
        # streamed to the servers as they are gathered) is the weight sync's choice (`weights.transport`).
        ship = self.weights.begin(self.version + 1, self.out / "weights")
        cmds = [Command("train", pieces=p, weights_dir=ship.weights_dir, weights_state=ship.want_state,
                        weights_stream=ship.stream) for p in pieces]
        try:
            res = await asyncio.to_thread(lambda: execute(self.engine, self.actor, scatter(cmds), sink=ship.sink))
        except BaseException as exc:
            ship.abandon(exc)
            raise
        await ship.landed(res.weights_dir, res.state)  # its checkpoint dir, before anything else can fail
        self._commit(collected)
        self.window.advance()
        await self.source.applied()
        self._wake_feeder()
        t_train = time.monotonic()
        await ship.finish(self.metrics)
        t_end = time.monotonic()
        facts = StepFacts(self.version, self.intake.counts, before, self.last_seq,
                          self.feeder.metric_values() if self.feeder is not None else {})
        values = step_values(facts, batch, [g.head_version for g in groups], res.stats, (t0, t_data, t_train, t_end))
        self._record({"version": self.version, "prompt_ids": [g.prompt_id for g in groups],
                      "seqs": [g.seq for g in groups], "last_seq": self.last_seq})
        if self.metrics is not None:
            # the run's step count: the version, less the first one when this run continued an earlier
            # run's numbering (so `jetrl up` shows step k/total_steps, not the version)
            await self.metrics.emit(values, step=self.window.steps, version=self.version)
        log.info("step", version=self.version, loss=round(values["loss"], 4), reward=round(values[REWARD_MEAN], 4),
                 train_s=round(values.get("train_time_s", 0.0), 2), resident_gib=round(res.stats.get("resident_gib", 0.0), 3),
                 peak_resident_gib=round(res.stats.get("peak_resident_gib", 0.0), 3),
                 **{k: round(v, 3) for k, v in res.stats.items() if k in _LOGGED})
        if self.settings.checkpoint_every and self.version % self.settings.checkpoint_every == 0:
            await self.checkpoint()
        if self.feeder is not None and self.settings.feeder.eval_every and self.version % self.settings.feeder.eval_every == 0:
            await self.feeder.issue_eval()
        return values

    def _commit(self, collected: Collected) -> None:
        """The step training the collected groups was applied: they are trained and `last_seq` covers
        every message read for it."""
        self.intake.commit([g.prompt_id for g in collected.groups])
        self.last_seq = max(self.last_seq, collected.last_seq)

    # ------------------------------------------------------------------------------ checkpoints

    async def checkpoint(self) -> Path:
        root = ckpt.checkpoint_root(self.settings.output_dir)
        tag = ckpt.tag_for(self.version)
        state = {
            "jetrl_version": self.version, "jetrl_last_seq": self.last_seq,
            "jetrl_feeder": self.feeder.state_dict() if self.feeder else None,
            "jetrl_intake": {**self.intake.state_dict(), **self.window.state_dict()}, "jetrl_rng": ckpt.rng_state(),
        }
        await asyncio.to_thread(
            lambda: execute(
                self.engine,
                self.actor,
                scatter(self._all(Command("save", directory=str(root), tag=tag, client_state=state))),
            )
        )
        ckpt.prune(root, self.settings.keep_checkpoints)
        self._record({"event": "checkpoint", "version": self.version, "last_seq": self.last_seq, "tag": tag})
        log.info("checkpoint saved", tag=tag, version=self.version, last_seq=self.last_seq)
        return root / tag

    def _restore(self, state: dict[str, Any]) -> None:
        self.window.load_state_dict(int(state["jetrl_version"]), state["jetrl_intake"])
        self.last_seq = int(state["jetrl_last_seq"])
        if self.feeder is not None and state.get("jetrl_feeder"):
            self.feeder.load_state_dict(state["jetrl_feeder"])
        self.intake.load_state_dict(state["jetrl_intake"])
        ckpt.set_rng_state(state["jetrl_rng"])

    def _record(self, row: dict[str, Any]) -> None:
        if self.settings.record_steps:
            with (self.out / "steps.jsonl").open("a") as f:
                f.write(json.dumps({"time": time.time(), **row}) + "\n")

    async def close(self) -> None:
        """Stop reading trajectories and eval answers, before the connection is drained: a pull
        request's late status left in the subscription's queue would hold the drain to its timeout.
        Nothing unacked is lost; JetStream redelivers it."""
        if self.feeder is not None:
            await self.feeder.close()
        await self.source.close()

    async def stop_followers(self) -> None:
        """Release the other ranks (they exit after this)."""
        if self.engine.world_size > 1:
            await asyncio.to_thread(lambda: scatter(self._all(Command("stop"))))

    @property
    def done(self) -> bool:
        if self.settings.total_steps and self.window.steps >= self.settings.total_steps:
            return True
        return self.source.exhausted or (self.feeder is not None and self.feeder.exhausted)


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
