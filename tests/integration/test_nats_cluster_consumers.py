"""Services that create their consumers while a real 3-node JetStream cluster has lost its majority (two
nodes just died, so neither the meta leader nor the streams' leaders can be elected) wait the outage
out and start once the nodes are back: the rollout worker's `declare()`, the trainer's consumer
`open()` and the replay reader. A consumer config the server refuses still fails at once, naming the
stream and the consumer."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, DeliverPolicy

from schemas.subjects import PROMPTS_STREAM, TRAJECTORIES_STREAM, Subjects
from services.bus.nats_cluster import NatsCluster
from services.common.bus import Bus, connect, declare_streams
from services.common.busretry import RetryPolicy, with_retries
from services.common.consumers import ConsumerRefused, add_consumer
from services.replay.reader import StreamReader
from services.replay.settings import RangeSettings
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import SGLangClient
from services.rollout.worker import RolloutWorker
from services.rollout.worker_config import WorkerConfig
from services.trainer.intake.consumer import TrajectoryConsumer
from services.trainer.intake.intake import Intake
from services.trainer.settings import TrainerSettings
from services.trainer.versions import VersionWindow
from tests.integration.test_rollout_version_gate import OneSample

T = TypeVar("T")
RUN = "outage"
S = Subjects(RUN)

FAULT_S = 10.0
"""How long the two nodes stay down after the service's first consumer request reached the survivor:
longer than nats-py's 5 s request timeout, so the request fails (a timeout or a 503) while they are."""


async def _prepare(cluster: NatsCluster, trajectories: int = 0) -> None:
    """Streams with 3 replicas, and `trajectories` recorded ones (their sequences are 1..n)."""
    nc = await connect(cluster.url, "admin")
    js = nc.jetstream()
    await declare_streams(js, replicas=3)
    for i in range(trajectories):
        await js.publish(S.trajectories, f"t{i}".encode(), stream=TRAJECTORIES_STREAM)
    await nc.close()


async def _started_while_the_majority_is_down(cluster: NatsCluster, start: Callable[[NATS], Awaitable[T]]) -> T:
    """Kill two of the three nodes, run `start` on a new connection given every node's URL (as a
    service started right then), keep the nodes down `FAULT_S` after its first consumer request, then
    restart them; returns what `start` returned."""
    survivor, downed = cluster.nodes[0], cluster.nodes[1:]
    for node in downed:
        node.kill()
    watcher = await connect(survivor.url, "watcher")
    asked = asyncio.Event()

    async def seen(_msg: Any) -> None:
        asked.set()

    await watcher.subscribe("$JS.API.CONSUMER.>", cb=seen)  # the service's consumer requests, as they reach the survivor
    service = await connect(cluster.url, "service")
    call = asyncio.create_task(start(service))
    waiting = asyncio.create_task(asked.wait())
    try:
        await asyncio.wait({call, waiting}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
        assert asked.is_set() or call.done(), "the service never asked for its consumer"
        if not call.done():
            await asyncio.wait({call}, timeout=FAULT_S)  # the fault: the nodes stay down this long
        for node in downed:
            await asyncio.to_thread(node.restart)
        return await call
    finally:
        waiting.cancel()
        call.cancel()
        await watcher.close()
        await service.close()


@pytest.mark.timeout(240)
async def test_a_rollout_worker_declares_its_consumer_through_the_outage(cluster: NatsCluster) -> None:
    await _prepare(cluster)
    config = WorkerConfig(worker="w", max_deliver=4)
    engine = SGLangClient(InferenceClientSettings(servers=["http://127.0.0.1:9"]))  # never asked: no episode runs

    async def start(nc: NATS) -> Any:
        # the service's `nats_replicas=3`, as its entry point's Bus carries it beside a 3-node cluster
        worker = RolloutWorker(nc, RUN, OneSample(), engine, config, bus=Bus(cluster.url, replicas=3))
        await worker.declare()
        return worker.max_deliver, await nc.jetstream().consumer_info(PROMPTS_STREAM, S.rollout_consumer)

    try:
        max_deliver, info = await _started_while_the_majority_is_down(cluster, start)
    finally:
        await engine.aclose()
    assert max_deliver == 4 and info.config.max_deliver == 4 and info.config.filter_subject == S.prompts_all


@pytest.mark.timeout(240)
async def test_the_trainer_opens_its_consumer_through_the_outage(cluster: NatsCluster) -> None:
    await _prepare(cluster, trajectories=3)
    settings = TrainerSettings(run=RUN, nats_url=cluster.url)

    async def start(nc: NATS) -> Any:
        consumer = TrajectoryConsumer(settings, Intake(VersionWindow(0), run=RUN))
        await consumer.open(nc, None, after_seq=1)  # a resume after sequence 1: the stale consumer is replaced
        info = await nc.jetstream().consumer_info(TRAJECTORIES_STREAM, S.trainer_consumer)
        await consumer.close()
        return info

    nc = await connect(cluster.url, "stale")
    # through the retrying helper: the streams' leaders may still be settling right after they were declared
    await add_consumer(nc.jetstream(), TRAJECTORIES_STREAM, ConsumerConfig(durable_name=S.trainer_consumer, filter_subject=S.trajectories),
                       policy=RetryPolicy())
    await nc.close()
    info = await _started_while_the_majority_is_down(cluster, start)
    assert info.config.opt_start_seq == 2
    # What the trainer gets from its consumer: sequences 2 and 3 (right after the election its count of
    # pending messages may lag and a fetch may meet a 503, so the messages are read as the trainer reads them)
    nc = await connect(cluster.url, "reader")
    sub = await nc.jetstream().pull_subscribe_bind(S.trainer_consumer, stream=TRAJECTORIES_STREAM)
    seqs: list[int] = []
    while len(seqs) < 2:  # timeouts and 503s waited out for up to 60 s, as the trainer's fetch does
        fetch = functools.partial(sub.fetch, 2 - len(seqs), timeout=5)
        seqs += [m.metadata.sequence.stream for m in await with_retries("fetch trajectories", fetch, 60, policy=RetryPolicy())]
    await nc.close()
    assert seqs == [2, 3]


@pytest.mark.timeout(240)
async def test_a_following_replay_reads_its_range_through_the_outage(cluster: NatsCluster) -> None:
    """Following, the consumer is the replay's first call. (A replay to the end first asks the stream's
    leader for the range's last message: test_nats_cluster_leaderless.py.)"""
    await _prepare(cluster, trajectories=3)
    rng = RangeSettings(to_seq=3, follow=True)

    async def start(nc: NATS) -> list[int]:
        return [r.seq async for r in StreamReader(nc.jetstream(), RUN, rng)]

    assert await _started_while_the_majority_is_down(cluster, start) == [1, 2, 3]


@pytest.mark.timeout(60)
async def test_a_consumer_config_the_server_refuses_fails_at_once_naming_it(nc: Any) -> None:
    js = nc.jetstream()
    bad = ConsumerConfig(durable_name="bad", filter_subject=S.prompts_all, deliver_policy=DeliverPolicy.BY_START_SEQUENCE)
    with pytest.raises(ConsumerRefused, match=f"stream {PROMPTS_STREAM}: consumer bad: .*code=400"):
        # that policy needs a start sequence; retried, it would end as BusUnavailable
        await add_consumer(js, PROMPTS_STREAM, bad, policy=RetryPolicy())
