"""`python -m services.trainer` with its default `bus_retry_timeout_s` rides out a long nats-server
outage (same port, same store) while it holds an accepted group of a step not yet trained: the pull
for trajectories, the held message's ack, the metrics and the feeder's prompt publishes all wait for
the server, and the run goes on: one process, every step trained, every group once."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from pathlib import Path

import pytest

from schemas.messages import PromptTask
from schemas.subjects import Subjects
from services.bus.nats_server import NatsServer
from services.common.bus import connect
from tests.support.trainer import (
    SERVICE_RUN,
    delivered_to_trainer,
    kill_group,
    make_group,
    publish_group,
    read_steps,
    start_trainer,
    take_prompts,
    trained_steps,
    until,
    write_dataset,
)

OUTAGE_S = 45.0
"""Minutes are the default budget; this is far longer than any one call's timeout (seconds)."""


@pytest.mark.timeout(400)
async def test_the_trainer_rides_out_a_long_outage_with_its_default_retry_budget(
    nats_server: NatsServer, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "trainer"
    out.mkdir()
    proc = start_trainer(
        nats_server.url, tiny_model, out, "feeder.enabled=true", f"feeder.dataset_path={write_dataset(tmp_path / 'd.jsonl', 30)}",
        "feeder.max_in_flight=2", "total_steps=3", "checkpoint_every=0",
    )
    S = Subjects(SERVICE_RUN)
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()

    async def prompts(n: int) -> list[PromptTask]:
        tasks: list[PromptTask] = []
        while len(tasks) < n:
            with contextlib.suppress(TimeoutError):
                tasks += await take_prompts(js, S.prompts_train, S.rollout_consumer, n - len(tasks))
            if proc.poll() is not None:
                raise RuntimeError(f"trainer exited with {proc.returncode}")
        return tasks

    async def answer(task: PromptTask) -> int:
        return await publish_group(js, SERVICE_RUN, task.prompt_id, make_group(tiny_model, task.data["answer"]))

    try:
        await until("the trainer to start", lambda: any(r.get("event") == "start" for r in read_steps(out)), 120, proc)
        for task in await prompts(2):
            await answer(task)
        await until("step 1", lambda: len(trained_steps(out)) == 1, 120, proc)

        # step 2: the trainer holds one accepted group when the server goes away
        first, second = await prompts(2)
        seq = await answer(first)
        await until("the first group of step 2 to reach the trainer", lambda: delivered_to_trainer(js, SERVICE_RUN, seq), 60, proc)
        await asyncio.to_thread(nats_server.stop)
        await asyncio.sleep(OUTAGE_S)  # the length of the outage, not a wait for a condition
        assert proc.poll() is None, "the trainer is still running after the outage"
        await asyncio.to_thread(nats_server.start)

        await answer(second)
        await until("step 2", lambda: len(trained_steps(out)) == 2, 120, proc)
        for task in await prompts(2):
            await answer(task)
        assert await asyncio.to_thread(proc.wait, 120) == 0
    finally:
        kill_group(proc)
        with contextlib.suppress(Exception):
            await nc.close()
    rows = read_steps(out)
    assert len([r for r in rows if r.get("event") == "start"]) == 1, "one process, no restart"
    assert [r["version"] for r in trained_steps(out)] == [1, 2, 3]
    assert sorted(trained_steps(out)[1]["prompt_ids"]) == sorted([first.prompt_id, second.prompt_id])
    assert all(n == 1 for n in Counter(p for r in trained_steps(out) for p in r["prompt_ids"]).values())


@pytest.mark.timeout(240)
async def test_an_announcement_lost_in_an_outage_skips_that_version_instead_of_stopping_the_trainer(
    nats_server: NatsServer, tiny_model: Path, tmp_path: Path
) -> None:
    """With a shared directory on the trainer's filesystem the weights are moved there before the
    announcement: when that announcement fails, the version cannot be published again. The trainer
    goes on and publishes the next one."""
    from services.trainer.loop import Trainer
    from services.trainer.model.engine import TrainEngine
    from services.trainer.settings import TrainerSettings
    from services.weights.sender.publisher import WeightPublisher, latest_published
    from services.weights.sender.sync import DiskWeights

    run, shared = "shared-outage", tmp_path / "shared"
    settings = TrainerSettings(run=run, nats_url=nats_server.url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"),
                               batch_groups=2, eta=100, checkpoint_every=0, fetch_timeout_s=0.2, feeder={"enabled": False},
                               weights={"transport": "shared_dir", "dir": str(shared)})
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    publisher = WeightPublisher(nc, run, shared_dir=shared)
    restarts: list[asyncio.Task[None]] = []

    async def restart_after(seconds: float) -> None:
        await asyncio.sleep(seconds)  # the length of the outage, not a wait for a condition
        await asyncio.to_thread(nats_server.start)

    async def publish(version: int, step: int, hf_dir: Path) -> object:
        if not restarts:  # the first announcement goes out while the server is away
            await publisher.latest()  # the publisher's streams are set up: the outage hits the announcement
            await asyncio.to_thread(nats_server.stop)
            restarts.append(asyncio.create_task(restart_after(8.0)))
        return await publisher.publish_dir(version, step, hf_dir, consume=True)

    trainer = Trainer(settings, TrainEngine(settings), weights=DiskWeights(publish, retry_s=settings.bus_retry_timeout_s))
    try:
        await trainer.start(nc)
        for i in range(4):
            await publish_group(js, run, f"p{i}", make_group(tiny_model, f"{i:03d}", seed=i))
        assert await trainer.step() is not None and trainer.version == 1, "the lost announcement did not stop the trainer"
        await restarts[0]
        assert await trainer.step() is not None and trainer.version == 2
        announced = await latest_published(nc, run)
        assert announced is not None and announced.version == 2
    finally:
        await trainer.close()
        await nc.close()
