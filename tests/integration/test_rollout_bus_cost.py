"""What one prompt costs the bus: counted by the nats-server itself (its /connz monitoring endpoint)
on the worker's own connection, with prompts arriving one at a time as a trainer's feeder issues them."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import nats

from schemas.subjects import TRAJECTORIES_STREAM
from services.bus.nats_server import NatsServer
from services.common.bus import connect, declare_streams
from services.rollout.workflows.synthetic import SyntheticWorkflow
from tests.support.rollout import RUN, S, collect, push_prompts, running_worker

PROMPTS = 12


def messages_from(server: NatsServer, name: str) -> int:
    """Messages the server received from the connection called `name` (pull requests, acks, publishes)."""
    with urllib.request.urlopen(f"http://{server.host}:{server.monitor_port}/connz?limit=1000", timeout=10) as reply:
        conns = json.load(reply)["connections"]
    [conn] = [c for c in conns if c.get("name") == name]
    return int(conn["in_msgs"])


async def test_a_prompt_costs_the_worker_its_ack_and_its_result_not_a_pull_round_trip(nats_server: NatsServer) -> None:
    feeder = await nats.connect(nats_server.url)
    worker_nc = await nats.connect(nats_server.url, name="counted-worker")
    try:
        js = feeder.jetstream()
        await declare_streams(js)
        results = await js.subscribe(S.trajectories, stream=TRAJECTORIES_STREAM)
        # long pull requests, so a slow machine renews them seldom: what is counted is per prompt
        async with running_worker(worker_nc, RUN, SyntheticWorkflow(group_size=1), None,
                                  max_concurrent=16, fetch_timeout_s=5.0):

            async def one(prefix: str) -> None:
                await push_prompts(js, 1, prefix=prefix)
                got: Any = await asyncio.wait_for(results.next_msg(timeout=30), 30)
                assert got.headers["Jetrl-Prompt-Id"] == f"{prefix}0"
                await got.ack()

            await one("warm-up-")  # the worker's start (its declarations) done before counting
            await worker_nc.flush()
            before = messages_from(nats_server, "counted-worker")
            for i in range(PROMPTS):  # one at a time, each after the last one's result
                await one(f"t{i}-")
            await worker_nc.flush()
            sent = messages_from(nats_server, "counted-worker") - before
    finally:
        await worker_nc.close()
        await feeder.close()
    # a prompt needs two: its result's publish and its ack; a pull request per prompt would be a third
    assert sent <= 2.5 * PROMPTS, f"the worker sent {sent} messages for {PROMPTS} prompts"


async def reconnected(*conns: Any, timeout_s: float = 60.0) -> None:
    """Until every connection is back (a readiness poll of the clients' own state)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not all(nc.is_connected for nc in conns):
        assert asyncio.get_running_loop().time() < deadline, "the clients did not reconnect"
        await asyncio.sleep(0.05)
    for nc in conns:
        await nc.flush()


async def test_the_standing_pull_resumes_after_the_server_restarts(nats_server: NatsServer) -> None:
    """A pull request waiting at the server is lost with the connection and no status says so: the
    worker writes it off when it would have expired and asks again, so prompts pushed after the
    restart are still run."""
    feeder = await connect(nats_server.url, "feeder")
    worker_nc = await connect(nats_server.url, "worker")
    try:
        js = feeder.jetstream()
        await declare_streams(js)
        async with running_worker(worker_nc, RUN, SyntheticWorkflow(group_size=1), None, fetch_timeout_s=1.0):
            await push_prompts(js, 1, prefix="before-")
            assert len(await collect(js, S.trajectories, 1)) == 1
            await asyncio.to_thread(nats_server.stop)  # off the loop: the clients go on running meanwhile
            await asyncio.to_thread(nats_server.restart)
            await reconnected(feeder, worker_nc)
            await push_prompts(js, 3, prefix="after-")
            got = await collect(js, S.trajectories, 4, timeout_s=60)
    finally:
        await worker_nc.close()
        await feeder.close()
    assert sorted(m.headers["Jetrl-Prompt-Id"] for m in got) == ["after-0", "after-1", "after-2", "before-0"]
