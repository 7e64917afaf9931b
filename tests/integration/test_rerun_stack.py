"""Running again under the same name on a bus that outlived the first run: a real nats-server, a real
CPU inference server with its weights agent and a rollout worker that keep running, and two trainers
one after the other with the same run name, the second without a checkpoint. The agent loaded the
first run's last version; the second trainer continues the numbering past it (its base weights are
published as the next version), so it trains, and only on groups generated with its own weights."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from structlog.testing import capture_logs

from schemas.subjects import TRAJECTORIES_STREAM
from schemas.trajectory import decode_group
from services.common.nats_server import free_port
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import InferenceEngine
from services.rollout.service import build_workflow, standard_kwargs
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from services.status.groups import render_groups, trainer_groups
from services.trainer.loop import Trainer
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from services.weights.sender.publisher import WeightPublisher, ensure_weight_sync_stream, latest_published
from services.weights.sender.sync import DiskWeights
from tests.integration.test_seed_workflows import rows
from tests.seed_workflows.rewards import copy3_reward_fn
from tests.support.rollout import running_worker
from tests.support.trainer import trained_steps
from tests.support.weights import Stack, process, server_version, wait_healthy

RUN = "again"
FIRST_STEPS = 2
STEP_TIMEOUT_S = 240.0
"""Generous: the machine is shared. Before the fix the second run never trained a step at all."""


def workflow(tiny_model: Path) -> Any:
    """The seed RLVR workflow with an in-process copy3 reward, as `jetrl rollout` builds it."""
    from transformers import AutoTokenizer

    settings = RolloutSettings(run=RUN, workflow="tests.seed_workflows.rlvr:RLVRWorkflow",
                               workflow_kwargs={"reward_fn": copy3_reward_fn}, group_size=3, max_new_tokens=4,
                               model_path=str(tiny_model))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    return build_workflow(settings, standard_kwargs(settings, lambda: tok, None))


def rollout_worker(nc: NATS, tiny_model: Path, engine: InferenceEngine) -> contextlib.AbstractAsyncContextManager[RolloutWorker]:
    return running_worker(nc, RUN, workflow(tiny_model), engine, nak_delay_s=0.1)


async def train(nc: NATS, settings: TrainerSettings, shared: Path, steps: int,
                logs: list[dict[str, Any]] | None = None) -> tuple[Trainer, list[dict[str, float]]]:
    """A trainer as `jetrl trainer` runs it (feeder, disk weights through the publisher), `steps` steps;
    returns it and each step's figures."""
    publisher = WeightPublisher(nc, RUN, shared_dir=shared)
    trainer = Trainer(settings, TrainEngine(settings), weights=DiskWeights(functools.partial(publisher.publish_dir, consume=True)))
    with capture_logs() as captured:
        await trainer.start(nc)
    if logs is not None:
        logs.extend(captured)
    stopping = asyncio.Event()
    assert trainer.feeder is not None
    feeding = asyncio.create_task(trainer.feeder.feed_forever(stopping))
    figures = []
    try:
        for _ in range(steps):
            try:
                values = await asyncio.wait_for(trainer.step(), STEP_TIMEOUT_S)
            except TimeoutError:
                pytest.fail(f"no step within {STEP_TIMEOUT_S} s at version {trainer.version}; "
                            f"the intake's verdicts: {dict(trainer.intake.counts)}")
            assert values is not None
            figures.append(values)
    finally:
        stopping.set()
        await asyncio.wait_for(feeding, 30)
        await trainer.close()
    return trainer, figures


@pytest.mark.timeout(900)
async def test_a_second_run_under_the_same_name_trains_past_the_first_runs_versions(
    nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows(64, chat=True)))
    shared = tmp_path / "shared"
    stack = Stack(nats_url, RUN, tmp_path, tiny_model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    nc = await nats.connect(nats_url)
    await ensure_weight_sync_stream(nc)

    def settings(name: str) -> TrainerSettings:
        return TrainerSettings(
            run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / name), batch_groups=2,
            eta=1, checkpoint_every=0, fetch_timeout_s=0.2,
            feeder={"dataset_path": str(dataset), "max_in_flight": 4},
        )

    engine = InferenceEngine(InferenceClientSettings(servers=[url]))
    try:
        with (
            process(stack.server_args(port), tmp_path / "server.log") as server,
            process(stack.agent_args(url, 0), tmp_path / "agent.log"),
        ):
            await wait_healthy(url, server, tmp_path / "server.log")
            async with rollout_worker(nc, tiny_model, engine):
                first, _ = await train(nc, settings("first"), shared, FIRST_STEPS)
                assert first.version == FIRST_STEPS
                announced = await latest_published(nc, RUN)
                assert announced is not None and announced.version == FIRST_STEPS

                # the second run: same name, no checkpoint; the server still serves the first run's last version
                logs: list[dict[str, Any]] = []
                second, figures = await train(nc, settings("second"), shared, 2, logs)
            assert await server_version(url) in {str(v) for v in range(FIRST_STEPS + 1, second.version + 1)}
    finally:
        await engine.aclose()

    base = FIRST_STEPS + 1
    said = [e for e in logs if e["event"].startswith(f"run {RUN} was used before")]
    assert said and said[0]["announced_version"] == FIRST_STEPS and said[0]["version"] == base, logs
    assert second.version == base + 2  # its base weights were version 3; two steps made 4 and 5
    steps = trained_steps(tmp_path / "second")
    assert [s["version"] for s in steps] == [base + 1, base + 2]
    assert all(0.0 <= f["reward_mean"] <= 1.0 and f["groups"] == 2 for f in figures), figures
    status = await trainer_groups(nc, RUN, 5.0)  # what `jetrl status` shows: this run's steps, no impossible group
    # this run's step count (2), not its version: `jetrl up` shows step k of its total_steps
    assert status.step == 2 and status.outcomes["accepted"] >= 4, render_groups(status)
    assert "impossible_versions" not in status.terminated, render_groups(status)

    # every group it trained was generated with its own weights, none with the first run's
    js = nc.jetstream()
    heads = []
    for step in steps:
        for seq in step["seqs"]:
            msg = await js.get_msg(TRAJECTORIES_STREAM, seq)
            heads.append(decode_group(msg.data or b"").meta.head_version)
    await nc.close()
    assert len(heads) == 4 and min(heads) >= base, heads
    assert second.intake.counts["terminated_impossible_versions"] == 0, dict(second.intake.counts)
