"""`python -m services.reward` as real processes beside a real nats-server: crashes and segfaults in
reward code cost one item, not the service; replicas in the queue group share the load and are
discoverable (PING, STATS); SIGTERM lets a request in flight finish, then the service exits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from schemas.messages import RewardItem, RewardReply, decode
from schemas.subjects import REWARD_SUBJECT
from services.common.bus import connect
from services.reward.client import RewardClient

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "jetrl-reward"


class Replicas:
    """Reward service subprocesses; every one is killed at teardown, whatever the test did."""

    def __init__(self, nats_url: str, logs: Path) -> None:
        self.nats_url = nats_url
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *overrides: str) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "JETRL_REWARD__NATS_URL": self.nats_url,
            "JETRL_REWARD__ALLOW": json.dumps(["tests.reward_fns:*"]),
        }
        log = (self.logs / f"reward-{len(self.procs)}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward", "run=rp", "processes=1", "log_format=json", "shutdown_timeout_s=10", *overrides],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def log_text(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in sorted(self.logs.glob("reward-*.log")))

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def replicas(nats_url: str, tmp_path: Path) -> Iterator[Replicas]:
    reps = Replicas(nats_url, tmp_path)
    try:
        yield reps
    finally:
        reps.kill_all()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    conn = await connect(nats_url, "reward-test")
    try:
        yield conn
    finally:
        await conn.close()


async def gather_replies(nc: NATS, subject: str, expect: int, deadline_s: float = 10.0) -> list[dict]:
    """Ask every instance (`$SRV.<VERB>.jetrl-reward`); collect replies until `expect` came back or
    the deadline passed (a loaded machine may answer slowly)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, b"", reply=inbox)
    replies: list[dict] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    try:
        while len(replies) < expect and loop.time() < end:
            try:
                msg = await sub.next_msg(timeout=max(0.01, end - loop.time()))
            except Exception:  # nats' TimeoutError: the deadline passed
                break
            if msg.data:  # an empty message with status 503 means no instance is subscribed yet
                replies.append(json.loads(msg.data))
    finally:
        await sub.unsubscribe()
    return replies


async def wait_for_instances(nc: NATS, replicas: Replicas, n: int, deadline_s: float = 60.0) -> list[dict]:
    """Poll discovery until `n` instances answer PING (each subscribes its endpoint first)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    pings: list[dict] = []
    while loop.time() < end:
        pings = await gather_replies(nc, f"$SRV.PING.{SERVICE}", n, deadline_s=0.5)
        if len(pings) >= n:
            return pings
        assert all(p.poll() is None for p in replicas.procs), f"a reward replica exited:\n{replicas.log_text()}"
    raise AssertionError(f"only {len(pings)} of {n} reward replicas answered PING:\n{replicas.log_text()}")


def item(completion: str = "abc", **row: object) -> RewardItem:
    return RewardItem(completion=completion, data=dict(row))


async def test_crash_and_segfault_fail_one_item_and_the_service_goes_on(nc: NATS, replicas: Replicas) -> None:
    proc = replicas.start()
    await wait_for_instances(nc, replicas, 1)
    client = RewardClient(nc, timeout_s=30)
    [before] = await client.score("tests.reward_fns:pid", [item()])

    [died] = await client.score("tests.reward_fns:exit_now", [item()])
    assert died.status == "error" and "exit code 7" in died.message and died.value is None
    [segv] = await client.score("tests.reward_fns:segfault", [item()])
    assert segv.status == "error" and "signal 11" in segv.message

    ok = await client.score("tests.reward_fns:length", [item("abcd"), item("")])
    assert [(r.status, r.value) for r in ok] == [("ok", 4.0), ("ok", 0.0)]
    [after] = await client.score("tests.reward_fns:pid", [item()])
    assert before.status == after.status == "ok" and before.value != after.value  # the process was replaced

    msg = await nc.request(REWARD_SUBJECT, b"\xc1garbage", timeout=10)
    assert decode(RewardReply, msg.data).error.startswith("malformed reward request")
    assert (await client.score("tests.reward_fns:length", [item("ab")]))[0].value == 2.0
    assert proc.poll() is None

    [stats] = await gather_replies(nc, f"$SRV.STATS.{SERVICE}", 1)
    data = stats["endpoints"][0]["data"]
    assert data["pool_restarts"] == 2 and data["requests_malformed"] == 1


async def test_two_replicas_share_requests_and_drain_on_sigterm(nc: NATS, replicas: Replicas) -> None:
    first, second = replicas.start("instance=r1", "shutdown_timeout_s=30"), replicas.start("instance=r2", "shutdown_timeout_s=30")
    pings = await wait_for_instances(nc, replicas, 2)
    assert sorted(p["metadata"]["instance"] for p in pings) == ["r1", "r2"]

    client = RewardClient(nc, timeout_s=60)
    batches = await asyncio.gather(*(client.score("tests.reward_fns:pid", [item()]) for _ in range(24)))
    scoring_pids = {b[0].value for b in batches}
    assert len(scoring_pids) == 2, "both replicas' pools should have scored items"
    stats = await gather_replies(nc, f"$SRV.STATS.{SERVICE}", 2)
    served = {s["metadata"]["instance"]: s["endpoints"][0]["num_requests"] for s in stats}
    assert set(served) == {"r1", "r2"} and all(n > 0 for n in served.values()) and sum(served.values()) == 24

    # SIGTERM with requests in flight: they are answered, then each replica exits cleanly
    pending = [asyncio.create_task(client.score("tests.reward_fns:sleepy", [item("abc", sleep_s=1.0)])) for _ in range(4)]
    while sum(s["endpoints"][0]["data"]["in_flight"] for s in await gather_replies(nc, f"$SRV.STATS.{SERVICE}", 2)) < 2:
        assert not any(t.done() for t in pending), "requests finished before the replicas were signalled"
    first.send_signal(signal.SIGTERM)
    second.send_signal(signal.SIGTERM)
    results = await asyncio.gather(*pending)
    assert all(r[0].status == "ok" and r[0].value == 3.0 for r in results)
    for proc in (first, second):
        assert await asyncio.to_thread(proc.wait, 40) == 0, replicas.log_text()
