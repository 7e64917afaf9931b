"""`python -m services.reward` as real processes beside a real nats-server: crashes and segfaults in
reward code cost one item, not the service; replicas in the queue group share the load and are
discoverable (PING, STATS); SIGTERM lets a request in flight finish, then the service exits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from schemas.messages import RewardItem, RewardReply, decode
from schemas.subjects import REWARD_SUBJECT
from services.reward.client import RewardClient
from tests.support.waiting import wait_until

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


def gone(pid: int) -> bool:
    """The process no longer runs (no such pid, or a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


async def test_exit_and_interrupt_in_a_function_are_errors_and_the_service_goes_on(nc: NATS, replicas: Replicas) -> None:
    proc = replicas.start()
    await wait_for_instances(nc, replicas, 1)
    client = RewardClient(nc, timeout_s=30)
    cases = [("exits_zero", "SystemExit"), ("interrupts", "KeyboardInterrupt"), ("raises_base", "ShoutError")]
    cases.append(("exits_hard_zero", "exit code 0"))  # os._exit(0): a "clean" exit mid-item is an error too
    for fn, name in cases:
        [res] = await client.score(f"tests.reward_fns:{fn}", [item()])
        assert res.status == "error" and name in res.message and res.value is None, res
        [ok] = await client.score("tests.reward_fns:length", [item("abcd")])
        assert (ok.status, ok.value) == ("ok", 4.0)
    assert proc.poll() is None, replicas.log_text()


async def test_children_of_a_function_do_not_outlive_its_item(nc: NATS, replicas: Replicas, tmp_path: Path) -> None:
    replicas.start()
    await wait_for_instances(nc, replicas, 1)
    client = RewardClient(nc, timeout_s=60)
    pids: list[int] = []
    try:
        for hang_s, timeout_s, status in ((0.0, 30.0, "ok"), (600.0, 1.0, "timeout")):
            pid_file = tmp_path / f"pids-{status}"
            [res] = await client.score("tests.reward_fns:spawns", [item(pid_file=str(pid_file), hang_s=hang_s)], item_timeout_s=timeout_s)
            assert res.status == status, res
            children = [int(p) for p in pid_file.read_text().split()][1:]
            pids += children
            all_gone = partial(lambda pids: all(map(gone, pids)), children)
            await asyncio.to_thread(wait_until, f"children {children} of a {status} item gone", all_gone, timeout_s=20)
        [ok] = await client.score("tests.reward_fns:length", [item("ab")])
        assert (ok.status, ok.value) == ("ok", 2.0)
    finally:
        for pid in pids:  # a failed run must not leave sleeps behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_a_good_item_is_answered_while_others_hang(nc: NATS, replicas: Replicas) -> None:
    # one pool process and four items that hang until their 30 s timeout: the good item, sent once
    # all four are being scored, must not wait for them
    replicas.start()
    await wait_for_instances(nc, replicas, 1)
    client = RewardClient(nc, timeout_s=90)
    hanging = [
        asyncio.create_task(client.score("tests.reward_fns:sleepy", [item("x", sleep_s=600)], item_timeout_s=30)) for _ in range(4)
    ]
    while sum(s["endpoints"][0]["data"]["in_flight"] for s in await gather_replies(nc, f"$SRV.STATS.{SERVICE}", 1)) < 4:
        assert not any(t.done() for t in hanging), [t.result() for t in hanging if t.done()]
    good = asyncio.create_task(client.score("tests.reward_fns:length", [item("abc")]))
    done, _ = await asyncio.wait({good, *hanging}, return_when=asyncio.FIRST_COMPLETED)
    assert good in done, "a hanging item was answered before the good one"
    assert [(r.status, r.value) for r in good.result()] == [("ok", 3.0)]
    for task in hanging:
        task.cancel()
    await asyncio.gather(*hanging, return_exceptions=True)


async def test_an_areal_signature_function_scores(nc: NATS, replicas: Replicas) -> None:
    replicas.start()
    await wait_for_instances(nc, replicas, 1)
    client = RewardClient(nc, timeout_s=30)
    areal = RewardItem(prompt="q", completion="abcd", prompt_ids=[1], completion_ids=[5, 6], data={"bonus": 10})
    [res] = await client.score("tests.reward_fns:areal_style", [areal])
    assert (res.status, res.value) == ("ok", 16.0), res
    narrow = await client.score("tests.reward_fns:only_what_it_needs", [item("7", answer="7", extra="x"), item("8", answer="7")])
    assert [(r.status, r.value) for r in narrow] == [("ok", 1.0), ("ok", 0.0)]


async def test_killing_the_service_ends_its_pool_and_what_reward_code_started(nc: NATS, replicas: Replicas, tmp_path: Path) -> None:
    proc = replicas.start()
    await wait_for_instances(nc, replicas, 1)
    client = RewardClient(nc, timeout_s=90)
    pid_file = tmp_path / "pids"
    hanging = asyncio.create_task(client.score("tests.reward_fns:spawns", [item(pid_file=str(pid_file), hang_s=600)], item_timeout_s=60))
    pids: list[int] = []
    try:
        await asyncio.to_thread(wait_until, "the item's pid file", pid_file.exists, timeout_s=30, proc=proc)
        pids = [int(p) for p in pid_file.read_text().split()]
        proc.kill()  # SIGKILL: the service cleans up nothing itself
        await asyncio.to_thread(proc.wait)
        await asyncio.to_thread(wait_until, f"pool process and children {pids} gone", lambda: all(map(gone, pids)), timeout_s=20)
    finally:
        hanging.cancel()
        await asyncio.gather(hanging, return_exceptions=True)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
