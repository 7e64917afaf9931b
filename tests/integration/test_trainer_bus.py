"""The trainer through nats-server restarts (same port, same store): prompt publishes, the pull for
trajectories and the weight publish ride out an outage longer than one call's timeout and the run goes
on; if the server stays away past `bus_retry_timeout_s`, the trainer checkpoints before giving up, and
a prompt it could not publish is not counted as issued."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from schemas.messages import PromptTask
from schemas.subjects import Subjects
from services.bus.nats_server import NatsServer
from services.common.bus import connect
from services.common.busretry import BusUnavailable
from services.trainer.loop import Trainer
from services.trainer.model import checkpoint as ckpt
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from services.weights.sender.publisher import WeightPublisher, latest_published
from services.weights.sender.sync import DiskWeights
from tests.support.trainer import (
    SERVICE_RUN,
    kill_group,
    make_group,
    publish_group,
    read_steps,
    start_trainer,
    take_prompts,
    trained_steps,
    until,
)
from tests.support.trainer import write_dataset as _dataset

RUN = "bus"
OUTAGE_S = 7.0
"""Longer than one publish attempt waits for its acknowledgement (5 s): a call made meanwhile fails."""


async def _stop(server: NatsServer) -> None:
    await asyncio.to_thread(server.stop)


async def _start_after(server: NatsServer, seconds: float) -> None:
    """Start the stopped server again, same port and store."""
    await asyncio.sleep(seconds)  # the length of the outage, not a wait for a condition
    await asyncio.to_thread(server.start)


async def _outage(server: NatsServer, seconds: float) -> None:
    await _stop(server)
    await _start_after(server, seconds)


def _settings(tmp_path: Path, tiny_model: Path, nats_url: str, **kw: Any) -> TrainerSettings:
    return TrainerSettings(
        run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), batch_groups=2, eta=100,
        checkpoint_every=0, fetch_timeout_s=0.2, feeder={"dataset_path": str(_dataset(tmp_path / "d.jsonl", 20)), "max_in_flight": 2},
        **kw,
    )


def _publish_with_outage(publisher: WeightPublisher, server: NatsServer, restart_after: float | None) -> Any:
    """The real weight publish; the first call happens while the server is away (for `restart_after`
    seconds, or for good)."""
    restarts: list[asyncio.Task[None]] = []

    async def publish(version: int, step: int, hf_dir: Path) -> Any:
        if not hasattr(publish, "stopped"):
            publish.stopped = True  # type: ignore[attr-defined]
            await _stop(server)
            if restart_after is not None:
                restarts.append(asyncio.create_task(_start_after(server, restart_after)))
        return await publisher.publish_dir(version, step, hf_dir)

    publish.restarts = restarts  # type: ignore[attr-defined]
    return publish


async def _answer(js: Any, tiny_model: Path, n: int) -> list[str]:
    S = Subjects(RUN)
    tasks = await take_prompts(js, S.prompts_train, S.rollout_consumer, 5)
    assert len(tasks) == n, "each prompt is queued once, whatever the retries"
    for t in tasks:
        await publish_group(js, RUN, t.prompt_id, make_group(tiny_model, t.data["answer"]))
    return [t.prompt_id for t in tasks]


@pytest.mark.timeout(240)
async def test_prompts_trajectories_and_weights_go_through_server_restarts(
    nats_server: NatsServer, tiny_model: Path, tmp_path: Path
) -> None:
    settings = _settings(tmp_path, tiny_model, nats_server.url, bus_retry_timeout_s=120)
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    publisher = WeightPublisher(nc, RUN)
    publish = _publish_with_outage(publisher, nats_server, OUTAGE_S)
    trainer = Trainer(settings, TrainEngine(settings), weights=DiskWeights(publish, retry_s=settings.bus_retry_timeout_s))
    try:
        await trainer.start(nc)
        assert trainer.feeder is not None

        # prompts published while the server is away
        await _stop(nats_server)
        restart = asyncio.create_task(_start_after(nats_server, OUTAGE_S))
        assert await trainer.feeder.feed_once() == 2
        await restart
        assert trainer.feeder.ledger.counters.issued == 2 and trainer.feeder.ledger.counters.in_flight == 2
        first = await _answer(js, tiny_model, 2)

        # the weights of step 1 published while the server is away
        assert await trainer.step() is not None and trainer.version == 1
        await publish.restarts[0]
        assert (await publisher.latest()).version == 1  # type: ignore[union-attr]

        # step 2 waits for trajectories through an outage
        step = asyncio.create_task(trainer.step())
        await _outage(nats_server, OUTAGE_S)
        assert await trainer.feeder.feed_once() == 2
        second = await _answer(js, tiny_model, 2)
        assert await step is not None and trainer.version == 2
        steps = [r["prompt_ids"] for r in read_steps(settings.output_dir) if "prompt_ids" in r]
        assert [sorted(s) for s in steps] == [sorted(first), sorted(second)]
        assert (await publisher.latest()).version == 2  # type: ignore[union-attr]
    finally:
        await trainer.close()
        await nc.close()


@pytest.mark.timeout(120)
async def test_when_the_server_stays_away_the_trainer_checkpoints_and_gives_up(
    nats_server: NatsServer, tiny_model: Path, tmp_path: Path
) -> None:
    settings = _settings(tmp_path, tiny_model, nats_server.url, bus_retry_timeout_s=2, total_steps=5)
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    publisher = WeightPublisher(nc, RUN, bus_retry_timeout_s=settings.bus_retry_timeout_s)  # as the service builds it
    publish = _publish_with_outage(publisher, nats_server, None)
    trainer = Trainer(settings, TrainEngine(settings), weights=DiskWeights(publish, retry_s=settings.bus_retry_timeout_s))
    try:
        await trainer.start(nc)
        assert trainer.feeder is not None
        feeder = trainer.feeder.ledger
        assert await trainer.feeder.feed_once() == 2
        await _answer(js, tiny_model, 2)
        with pytest.raises(BusUnavailable):
            await trainer.run(asyncio.Event())  # step 1 trains, then its weights cannot be published
        root = ckpt.checkpoint_root(settings.output_dir)
        assert ckpt.latest(root) == ckpt.tag_for(1), "the trained step was saved before giving up"

        counters = vars(feeder.counters).copy()
        with pytest.raises(BusUnavailable):
            await trainer.feeder.feed_once()
        assert vars(feeder.counters) == counters and feeder.counters.in_flight == 0  # the rows are back in line
        assert len(feeder.reissue) == 2, "the round's two prompts were both tried (pipelined) and both put back"
    finally:
        await trainer.close()
        with contextlib.suppress(ConnectionResetError):  # the server is gone
            await nc.close()


@pytest.mark.timeout(300)
async def test_the_trainer_service_continues_and_finishes_after_a_server_restart(
    nats_server: NatsServer, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "trainer"
    out.mkdir()
    proc = start_trainer(
        nats_server.url, tiny_model, out, "feeder.enabled=true", f"feeder.dataset_path={_dataset(tmp_path / 'd.jsonl', 30)}",
        "feeder.max_in_flight=2", "total_steps=4", "checkpoint_every=0", "weights.transport=store", "bus_retry_timeout_s=120",
    )
    S = Subjects(SERVICE_RUN)
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    try:
        await until("the trainer to start", lambda: any(r.get("event") == "start" for r in read_steps(out)), 120, proc)
        for step in range(1, 5):  # act as the rollout side: answer the two prompts each step needs
            tasks: list[PromptTask] = []
            while len(tasks) < 2:
                with contextlib.suppress(TimeoutError):
                    tasks += await take_prompts(js, S.prompts_train, S.rollout_consumer, 2 - len(tasks))
                if proc.poll() is not None:
                    raise RuntimeError(f"trainer exited with {proc.returncode} before step {step}")
            for t in tasks:
                await publish_group(js, SERVICE_RUN, t.prompt_id, make_group(tiny_model, t.data["answer"]))
            if step == 3:
                # the trainer is about to train step 3, publish its weights and the next prompts
                await _outage(nats_server, OUTAGE_S)
            await until(f"step {step}", lambda: len(trained_steps(out)) >= step, 120, proc)  # noqa: B023
        assert await asyncio.to_thread(proc.wait, 120) == 0
    finally:
        kill_group(proc)
    rows = read_steps(out)
    assert len([r for r in rows if r.get("event") == "start"]) == 1, "one process, no restart"
    assert [r["version"] for r in rows if "prompt_ids" in r] == [1, 2, 3, 4]
    assert all(n == 1 for n in Counter(p for r in rows if "prompt_ids" in r for p in r["prompt_ids"]).values())
    announced = await latest_published(nc, SERVICE_RUN)
    await nc.close()
    assert announced is not None and announced.version == 4
