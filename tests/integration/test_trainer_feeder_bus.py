"""The trainer's feeder on a real nats-server, on its own (no model, no engine): it opens its
subscriptions when started, turns a dead-lettered prompt into a rejection that is issued again, and
leaves no subscription behind when closed. On a 3-node cluster, a dead-letter advisory that arrives
while the prompts' stream has no leader (the advisory comes once) is still turned into a rejection."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas.subjects import PROMPTS_STREAM, Subjects
from services.common.bus import connect, declare_streams
from services.common.metrics import MetricsPublisher
from services.common.nats_cluster import NatsCluster
from services.trainer.feed.feeder import Feeder
from services.trainer.intake.intake import Intake
from services.trainer.settings import TrainerSettings
from services.trainer.versions import VersionWindow
from tests.support.trainer import until, write_dataset

RUN = "fb"


@pytest.mark.timeout(60)
async def test_the_feeder_owns_its_subscriptions_and_reissues_a_dead_letter(nats_url: str, tmp_path: Path) -> None:
    settings = TrainerSettings(
        run=RUN, nats_url=nats_url, batch_groups=2, eta=0,
        feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 10)), "max_in_flight": 1, "eval_every": 5,
                "eval_dataset_path": str(write_dataset(tmp_path / "e.jsonl", 3))},
    )
    feeder = Feeder(settings, window := VersionWindow(settings.eta), Intake(window), gate_versions=False)
    nc = await connect(nats_url, "test")
    try:
        js = nc.jetstream()
        await declare_streams(js)
        subjects = Subjects(RUN)
        # the rollout side's consumer, giving up on a prompt after one delivery
        await js.add_consumer(PROMPTS_STREAM, ConsumerConfig(
            durable_name=subjects.rollout_consumer, filter_subject=subjects.prompts_all, ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL, max_deliver=1, ack_wait=1.0))
        before = len(nc._subs)
        await feeder.start(nc, MetricsPublisher(nc, RUN, "trainer"))
        assert len(nc._subs) == before + 2, "dead-letter advisories and eval answers"

        assert await feeder.feed_once() == 1
        first = next(iter(feeder.ledger.in_flight))
        sub = await js.pull_subscribe_bind(subjects.rollout_consumer, stream=PROMPTS_STREAM)
        [msg] = await sub.fetch(1, timeout=5)
        await msg.nak()  # its one delivery failed: asked for it again, the server gives up on it and says so
        with pytest.raises(TimeoutError):
            await sub.fetch(1, timeout=1)

        await until("the dead letter to be counted", lambda: feeder.ledger.counters.rejected == 1, 30)
        assert first not in feeder.ledger.in_flight and len(feeder.ledger.reissue) == 1
        assert await feeder.feed_once() == 1  # the slot is free: the row goes out again, under a new id
        assert next(iter(feeder.ledger.in_flight)) == f"{first}-r1"
        await sub.unsubscribe()

        await feeder.close()
        assert len(nc._subs) == before, "closed, the feeder leaves no subscription behind"
    finally:
        await nc.close()


FAULT_S = 10.0
"""How long the prompts' stream stays without a leader after the advisory: past nats-py's 5 s request timeout."""


@pytest.mark.timeout(180)
async def test_a_dead_letter_advised_while_the_stream_has_no_leader_is_still_reissued(cluster: NatsCluster, tmp_path: Path) -> None:
    survivor, downed = cluster.nodes[0], cluster.nodes[1:]
    settings = TrainerSettings(run=RUN, nats_url=survivor.url, batch_groups=2, eta=0, bus_retry_timeout_s=120,
                               feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 10)), "max_in_flight": 1})
    feeder = Feeder(settings, window := VersionWindow(settings.eta), Intake(window), gate_versions=False)
    admin = await connect(cluster.url, "admin")
    await declare_streams(admin.jetstream(), replicas=3)
    await admin.close()
    nc = await connect(survivor.url, "trainer")  # on the node that stays: its subscriptions live through the fault
    try:
        await feeder.start(nc, None)
        assert await feeder.feed_once() == 1
        first = next(iter(feeder.ledger.in_flight))
        seq = (await nc.jetstream().stream_info(PROMPTS_STREAM)).state.last_seq
        for node in downed:
            node.kill()
        # what the server sends once a prompt's last delivery failed (the server's own is tested above)
        await nc.publish(f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{PROMPTS_STREAM}.{Subjects(RUN).rollout_consumer}",
                         json.dumps({"stream_seq": seq}).encode())
        await asyncio.sleep(FAULT_S)  # the fault itself: the stream stays without a leader this long
        for node in downed:
            await asyncio.to_thread(node.restart)
        await until("the dead letter to be counted", lambda: feeder.ledger.counters.rejected == 1, 90)
        assert first not in feeder.ledger.in_flight and len(feeder.ledger.reissue) == 1
        await feeder.close()
    finally:
        await nc.close()
