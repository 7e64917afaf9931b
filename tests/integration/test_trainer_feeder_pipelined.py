"""The feeder's prompts on a real nats-server go out pipelined: a round of prompts is written to the
socket together (not one round trip per prompt, each waking the server and the trainer's event loop),
in the ledger's order; a round that fails puts every row back, in order, and they go out again."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from schemas.messages import PromptTask, decode
from schemas.subjects import PROMPTS_STREAM
from services.common.bus import connect, declare_streams
from services.common.busretry import BusUnavailable
from services.common.nats_server import NatsServer
from services.trainer.feed.feeder import Feeder
from services.trainer.intake.intake import Intake
from services.trainer.settings import TrainerSettings
from services.trainer.versions import VersionWindow
from tests.support.trainer import until, write_dataset

RUN = "fp"
N = 8


def _feeder(nats_url: str, tmp_path: Path) -> Feeder:
    settings = TrainerSettings(run=RUN, nats_url=nats_url, batch_groups=N, eta=0, bus_retry_timeout_s=2,
                               feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 20)), "max_in_flight": N})
    return Feeder(settings, window := VersionWindow(settings.eta), Intake(window), gate_versions=False)


async def _queued(js: Any) -> list[str]:
    info = await js.stream_info(PROMPTS_STREAM)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(PROMPTS_STREAM, seq)
        out.append(decode(PromptTask, msg.data or b"").prompt_id)
    return out


@pytest.mark.timeout(60)
async def test_a_round_of_prompts_leaves_in_one_write_in_the_ledgers_order(nats_url: str, tmp_path: Path) -> None:
    feeder = _feeder(nats_url, tmp_path)
    nc = await connect(nats_url, "test")
    try:
        js = nc.jetstream()
        await declare_streams(js)
        await feeder.start(nc, None)
        transport = nc._transport
        real = transport.writelines
        writes: list[int] = []

        def counting(data: Any) -> None:
            writes.append(sum(len(d) for d in data))
            real(data)

        transport.writelines = counting  # the real write, counted
        try:
            assert await feeder.feed_once() == N
        finally:
            transport.writelines = real
        # each prompt one by one would be N writes (and N round trips)
        assert len(writes) <= 2, f"{len(writes)} socket writes for a round of {N} prompts"
        assert await _queued(js) == list(feeder.ledger.in_flight), "in the stream in the order they were issued"
        assert feeder.ledger.counters.issued == N and not feeder.ledger._unconfirmed
        await feeder.close()
    finally:
        await nc.close()


@pytest.mark.timeout(120)
async def test_a_round_that_cannot_be_published_goes_back_in_line_whole_and_in_order(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    feeder = _feeder(nats_server.url, tmp_path)
    nc = await connect(nats_server.url, "test")
    try:
        js = nc.jetstream()
        await declare_streams(js)
        await feeder.start(nc, None)
        await feeder.close()  # its subscriptions are not under test
        ledger = feeder.ledger
        await asyncio.to_thread(nats_server.stop)
        with pytest.raises(BusUnavailable):
            await feeder.feed_once()
        # nothing counted as issued; every row waits to go out first
        assert ledger.counters.issued == 0 and not ledger.in_flight and not ledger._unconfirmed
        assert len(ledger.reissue) == N

        await asyncio.to_thread(nats_server.start)
        await until("the client to reconnect", lambda: nc.is_connected, 30)
        assert await feeder.feed_once() == N
        assert ledger.counters.issued == N and not ledger.reissue
        fresh = _feeder(nats_server.url, tmp_path).ledger  # the same dataset and seed, nothing published
        first_round = [task.prompt_id for task in (fresh.next_task(0) for _ in range(N)) if task is not None]
        assert await _queued(js) == first_round, "the same prompts went out again, in their order"
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
