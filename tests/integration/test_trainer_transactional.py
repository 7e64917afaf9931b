"""A group counts as trained only when its step is applied: SIGTERM to `python -m services.trainer`
while it holds an accepted group for a step not yet trained, then `--resume auto`: counted from the
TRAJECTORIES stream and the trainer's step record, every group is trained exactly once (none lost,
none twice), and the checkpoint's `last_seq` is where the trained steps end."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections import Counter
from pathlib import Path

import pytest

from services.bus.nats_server import NatsServer
from services.common.bus import connect, declare_streams
from services.common.busretry import BusUnavailable
from services.trainer.loop import Trainer
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from tests.support.trainer import SERVICE_RUN as RUN
from tests.support.trainer import (
    delivered_to_trainer,
    kill_group,
    make_group,
    publish_group,
    read_steps,
    start_trainer,
    stream_groups,
    trained_steps,
    until,
)

SHUTDOWN_S = 10.0
ARGS = ("checkpoint_every=0", f"shutdown_timeout_s={SHUTDOWN_S}")


@pytest.mark.timeout(300)
async def test_sigterm_mid_collect_then_resume_trains_every_group_exactly_once(
    nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "trainer"
    out.mkdir()
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await declare_streams(js)

    async def publish(i: int) -> int:
        return await publish_group(js, RUN, f"p{i}", make_group(tiny_model, f"{i:03d}", seed=i))

    for i in range(2):  # step 1 (batch_groups=2)
        await publish(i)
    proc = start_trainer(nats_url, tiny_model, out, *ARGS, "total_steps=0")
    try:
        await until("step 1", lambda: len(trained_steps(out)) == 1, 120, proc)
        # one group of step 2: the trainer reads and accepts it, then waits for the second
        held = await publish(2)
        await until("p2 to reach the trainer", lambda: delivered_to_trainer(js, RUN, held), 60, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=SHUTDOWN_S) == 0
    finally:
        kill_group(proc)
    step1 = trained_steps(out)[0]
    saved = [r for r in read_steps(out) if r.get("event") == "checkpoint"][-1]
    assert saved["version"] == 1
    assert saved["last_seq"] == max(step1["seqs"]), "the checkpoint covers what was trained, not what was read"

    for i in range(3, 7):  # enough for two more steps however p2 fares
        await publish(i)
    again = start_trainer(nats_url, tiny_model, out, *ARGS, "total_steps=3", "--resume", "auto")
    try:
        assert again.wait(timeout=180) == 0
    finally:
        kill_group(again)
    groups = await stream_groups(js, RUN)
    await nc.close()

    rows = read_steps(out)
    final = [r for r in rows if r.get("event") == "checkpoint"][-1]
    assert final["version"] == 3
    trained = Counter(pid for r in trained_steps(out) for pid in r["prompt_ids"])
    assert [r["version"] for r in trained_steps(out)] == [1, 2, 3]
    due = {pid for seq, pid in groups.items() if seq <= final["last_seq"]}
    assert "p2" in trained, "the group held at SIGTERM was trained after the resume"
    assert set(trained) == due, "every group up to the checkpoint's last_seq trained, none after it"
    assert all(n == 1 for n in trained.values()), f"trained twice: {trained}"


@pytest.mark.timeout(240)
async def test_bus_lost_mid_collect_then_resume_trains_the_held_group(nats_server: NatsServer, tiny_model: Path, tmp_path: Path) -> None:
    """The server goes away for good while the trainer holds an accepted group: it gives up after
    `bus_retry_timeout_s` with a checkpoint of what it trained; a resume trains the held group."""
    run = "busloss"
    settings = TrainerSettings(run=run, nats_url=nats_server.url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"),
                               batch_groups=2, eta=100, checkpoint_every=0, fetch_timeout_s=0.2, feeder={"enabled": False},
                               weights={"transport": "none"}, bus_retry_timeout_s=2)
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await declare_streams(js)
    seqs = {f"p{i}": await publish_group(js, run, f"p{i}", make_group(tiny_model, f"{i:03d}", seed=i)) for i in range(3)}
    trainer = Trainer(settings, TrainEngine(settings))
    await trainer.start(nc)
    running = asyncio.create_task(trainer.run(asyncio.Event()))
    try:
        while not (trainer.version == 1 and await delivered_to_trainer(js, run, seqs["p2"])):
            assert not running.done(), running
            await asyncio.sleep(0.1)  # the poll interval of a condition
        await asyncio.to_thread(nats_server.stop)
        with pytest.raises(BusUnavailable):
            await asyncio.wait_for(running, 120)
    finally:
        await trainer.close()
        with contextlib.suppress(ConnectionResetError):  # the server is gone
            await nc.close()
    saved = [r for r in read_steps(settings.output_dir) if r.get("event") == "checkpoint"]
    assert [(r["version"], r["last_seq"]) for r in saved] == [(1, seqs["p1"])], "the checkpoint covers what was trained"

    await asyncio.to_thread(nats_server.start)
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    for i in (3, 4):
        await publish_group(js, run, f"p{i}", make_group(tiny_model, f"{i:03d}", seed=i))
    again = Trainer(settings.model_copy(update={"resume": "auto"}), TrainEngine(settings))
    try:
        await again.start(nc)
        assert await asyncio.wait_for(again.step(), 120) is not None
    finally:
        await again.close()
        await nc.close()
    last = [r for r in read_steps(settings.output_dir) if "prompt_ids" in r][-1]
    assert last["version"] == 2 and sorted(last["prompt_ids"]) == ["p2", "p3"]
