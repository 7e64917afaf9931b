"""A real 3-node JetStream cluster on 127.0.0.1: streams declared with 3 replicas; the leader of the
trajectory stream is SIGKILLed while a producer publishes and a durable consumer fetches and acks
through one client given every node's URL; nothing is lost or delivered as new twice, and the node,
restarted, catches up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest

from schemas.subjects import TRAJECTORIES_STREAM, WEIGHTS_BUCKET, stream_specs
from services.bus.nats_cluster import NatsCluster
from services.common.bus import connect, declare_streams
from services.common.busretry import RetryPolicy
from services.weights.objstore import open_bucket

N = 400


async def _retry(what: str, call: object, deadline_s: float = 60.0) -> object:
    """A JetStream call through a leader election: retried until it succeeds (elections take seconds)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        try:
            return await call()  # type: ignore[operator]
        except (nats.errors.TimeoutError, nats.js.errors.APIError, nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
            if loop.time() > end:
                raise
            await asyncio.sleep(0.2)  # the cluster is electing a new leader


@pytest.mark.timeout(300)
async def test_r3_streams_survive_losing_the_leader(cluster: NatsCluster) -> None:
    nc = await connect(cluster.url, "cluster-test")
    js = nc.jetstream()
    created = await declare_streams(js, replicas=3)
    assert set(created.values()) == {"created"}
    info = await js.stream_info(TRAJECTORIES_STREAM)
    assert info.config.num_replicas == 3 and info.cluster is not None and len(info.cluster.replicas or []) == 2
    # declaring again with another count scales the stream, and says so
    assert (await declare_streams(js, [s for s in stream_specs() if s.name == TRAJECTORIES_STREAM], replicas=1)) == {
        TRAJECTORIES_STREAM: "updated"}
    assert (await js.stream_info(TRAJECTORIES_STREAM)).config.num_replicas == 1
    await declare_streams(js, replicas=3)

    sub = await js.pull_subscribe("jetrl.c.trajectories", durable="trainer-c", stream=TRAJECTORIES_STREAM)
    got: list[int] = []

    async def consume(until: int) -> None:
        while len(set(got)) < until:
            try:
                msgs = await sub.fetch(50, timeout=1)
            except (nats.errors.TimeoutError, nats.js.errors.APIError, nats.errors.ConnectionReconnectingError,
                    nats.js.errors.NoStreamResponseError):
                continue
            for m in msgs:
                if m.metadata.num_delivered == 1:  # a redelivery of an unacked message is not a new message
                    got.append(int(m.data))
                await _retry("ack", lambda m=m: m.ack_sync(timeout=5))

    for i in range(N // 2):
        await _retry("publish", lambda i=i: js.publish("jetrl.c.trajectories", str(i).encode(), headers={"Nats-Msg-Id": f"c/{i}"}))
    await consume(N // 4)

    leader_name = (await js.stream_info(TRAJECTORIES_STREAM)).cluster.leader  # type: ignore[union-attr]
    leader = cluster.node_named(str(leader_name))
    leader.kill()
    for i in range(N // 2, N):
        await _retry("publish", lambda i=i: js.publish("jetrl.c.trajectories", str(i).encode(), headers={"Nats-Msg-Id": f"c/{i}"}))
    await asyncio.wait_for(consume(N), timeout=180)
    assert sorted(got) == list(range(N)), "a message was lost or delivered as new twice"
    new_leader = (await _retry("info", lambda: js.stream_info(TRAJECTORIES_STREAM))).cluster.leader  # type: ignore[attr-defined]
    assert new_leader != leader_name

    await asyncio.to_thread(leader.restart)
    async def caught_up() -> bool:
        state = await js.stream_info(TRAJECTORIES_STREAM)
        return all(r.current for r in state.cluster.replicas or []) and len(state.cluster.replicas or []) == 2  # type: ignore[union-attr]
    for _ in range(300):
        if await _retry("info", caught_up):
            break
        await asyncio.sleep(0.2)
    else:
        pytest.fail("the restarted node did not catch up")
    assert (await js.stream_info(TRAJECTORIES_STREAM)).state.messages == N
    await nc.close()


def test_jetrl_nats_cluster_prints_the_urls_and_serves(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "nats", "--cluster", "3", "--store-dir", str(tmp_path)],
                            cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert "cluster of 3 ready" in first, first
        url = first.split("nats_url=")[1].split()[0]
        assert url.count("nats://127.0.0.1:") == 3

        async def use() -> int:
            nc = await connect(url, "cli-check")
            created = await declare_streams(nc.jetstream(), replicas=3)
            await nc.close()
            return len(created)

        assert asyncio.run(use()) == len(stream_specs())
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@pytest.mark.timeout(120)
async def test_declaring_streams_waits_out_a_cluster_still_electing(tmp_path: Path) -> None:
    """A service started beside a cluster that has not elected its JetStream meta leader yet (or whose
    first API answers are slow) opens its bucket and declares its streams once the cluster answers,
    instead of dying on the first timeout or 503."""
    c = NatsCluster(tmp_path / "forming", 3)
    try:
        for node in c.nodes:
            node.start_detached()
        for node in c.nodes:
            await asyncio.to_thread(node.wait_ready, 60)  # client ports open; no meta leader asked for
        nc = await connect(c.url, "early-service")
        store = await open_bucket(nc.jetstream(), WEIGHTS_BUCKET, replicas=3, policy=RetryPolicy())  # as the weights publisher starts
        assert (await store.status()).replicas == 3
        created = await declare_streams(nc.jetstream(), replicas=3)
        assert set(created.values()) == {"created"} and len(created) == len(stream_specs())
        await nc.close()
    finally:
        c.stop()


def test_a_cluster_whose_port_is_taken_before_a_node_binds_it_starts_on_fresh_ports(tmp_path: Path) -> None:
    """Ports are picked before the nodes bind them, so another process (a second test run beside this
    one) can take one in between: that node exits at once ("address already in use"), and the cluster
    starts again on fresh ports instead of failing."""
    import socket

    cluster = NatsCluster(tmp_path / "c", 3)
    taken = cluster.nodes[1].port
    with socket.socket() as thief:
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        thief.bind(("127.0.0.1", taken))
        thief.listen()
        try:
            cluster.start(timeout_s=60)
            assert taken not in [n.port for n in cluster.nodes]
            assert cluster.wait_meta_leader(10)  # a working cluster on the new ports
            assert "address already in use" in (tmp_path / "c" / "n1.log").read_text()  # the first try met the taken port
        finally:
            cluster.stop()
