"""The reward service in the test's event loop against a real nats-server, with a real process pool:
correct scores, a timeout that hits one item only, refusals with clear messages, malformed bytes,
metrics on the METRICS stream, and the client's error when nobody answers."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from schemas.messages import MetricsEvent, RewardItem, RewardReply, decode
from schemas.subjects import REWARD_SUBJECT, Subjects
from services.common.health import evaluate_checks
from services.reward.client import RewardClient, RewardRequestError, RewardUnavailableError
from services.reward.proctree import alive, descendants
from services.reward.service import RewardService
from services.reward.settings import RewardSettings
from tests.support.reward import running_reward
from tests.support.waiting import wait_until

RUN = "rwd"


@pytest.fixture
async def service(nats_url: str, nc: NATS) -> AsyncIterator[RewardService]:
    settings = RewardSettings(
        run=RUN, nats_url=nats_url, processes=2, allow=["tests.reward_fns:*"], item_timeout_s=2.0, metrics_interval_s=0.2
    )
    async with running_reward(settings, nc) as svc:
        yield svc


def item(completion: str, **row: object) -> RewardItem:
    return RewardItem(prompt="q", completion=completion, data=dict(row))


async def test_builtin_rewards_score_correctly(service: RewardService, nc: NATS) -> None:
    client = RewardClient(nc, timeout_s=20)
    copy3 = await client.score(
        "services.reward.builtin:copy3", [item("123", answer="123"), item("193", answer="123"), item("", answer="123")]
    )
    assert [(r.status, r.value) for r in copy3] == [("ok", 1.0), ("ok", pytest.approx(2 / 3)), ("ok", 0.0)]
    numeric = await client.score("services.reward.builtin:numeric_match", [item("so 42", answer="42"), item("41", answer="42")])
    assert [r.value for r in numeric] == [1.0, 0.0]
    math = await client.score(
        "services.reward.builtin:math_verify", [item(r"$\boxed{\frac{3}{4}}$", answer="0.75"), item("1", answer="0.75")]
    )
    assert [r.value for r in math] == [1.0, 0.0]
    # a row the function cannot score is an error with the reason, not a 0
    bad = await client.score("services.reward.builtin:numeric_match", [item("42", answer="forty-two"), item("42", answer="42")])
    assert bad[0].status == "error" and "not a number" in bad[0].message and bad[0].value is None
    assert (bad[1].status, bad[1].value) == ("ok", 1.0)


async def test_item_past_its_timeout_is_timeout_and_the_others_are_ok(service: RewardService, nc: NATS) -> None:
    client = RewardClient(nc, timeout_s=20)
    items = [item("a", sleep_s=0), item("bb", sleep_s=60), item("ccc", sleep_s=0.05), item("dddd", sleep_s=0)]
    results = await client.score("tests.reward_fns:sleepy", items, item_timeout_s=0.5)
    assert [r.status for r in results] == ["ok", "timeout", "ok", "ok"]
    assert [r.value for r in results] == [1.0, None, 3.0, 4.0]
    assert "0.5 s" in results[1].message
    # the killed process was replaced: the pool still runs two items at once
    again = await client.score("tests.reward_fns:sleepy", [item("xy", sleep_s=0.3), item("z", sleep_s=0.3)], item_timeout_s=5)
    assert [(r.status, r.value) for r in again] == [("ok", 2.0), ("ok", 1.0)]
    assert service.pool.restarts == 1


async def test_a_cheap_functions_request_is_one_batch_and_a_crash_in_it_fails_one_item(service: RewardService, nc: NATS) -> None:
    client = RewardClient(nc, timeout_s=30)
    # the first request of a function not yet measured is split over both processes
    first = await client.score("tests.reward_fns:pid", [item("a") for _ in range(8)])
    assert len({r.value for r in first}) == 2
    # measured cheap now: the whole request goes to one process, in one message
    second = await client.score("tests.reward_fns:pid", [item("a") for _ in range(8)])
    assert len({r.value for r in second}) == 1
    await client.score("tests.reward_fns:exits_if", [item("a")])  # measured cheap too
    # the process dies on the second item of its batch: that item alone is an error; the items it
    # had scored (lost with it) and the items after it are scored again elsewhere
    items = [item("a"), item("bb", crash=True), item("ccc"), item("dddd")]
    results = await client.score("tests.reward_fns:exits_if", items)
    assert [(r.status, r.value) for r in results] == [("ok", 1.0), ("error", None), ("ok", 3.0), ("ok", 4.0)]
    assert "exit code 7" in results[1].message and service.pool.restarts == 1


async def test_a_pool_process_killed_while_idle_is_replaced_before_the_next_item(nats_url: str, nc: NATS) -> None:
    settings = RewardSettings(run=RUN, nats_url=nats_url, processes=1, allow=["tests.reward_fns:*"])
    async with running_reward(settings, nc) as svc:
        client = RewardClient(nc, timeout_s=30)
        [before] = await client.score("tests.reward_fns:pid", [item("a")])
        os.kill(int(before.value or 0), signal.SIGKILL)  # the OOM killer, say, while it waits for work
        await asyncio.to_thread(wait_until, "the killed process replaced", lambda: svc.pool.restarts == 1, timeout_s=30)
        [after] = await client.score("tests.reward_fns:pid", [item("a")])
        assert after.status == "ok" and after.value != before.value


async def test_pool_processes_outlive_their_fork_server(nats_url: str, nc: NATS) -> None:
    # SIGTERM to the service's process group (as `jetrl up` stops it) ends the fork server first; its
    # children's exit sentinels then close while they still run: not a reason to fail or replace them
    settings = RewardSettings(run=RUN, nats_url=nats_url, processes=1, allow=["tests.reward_fns:*"])
    async with running_reward(settings, nc) as svc:
        client = RewardClient(nc, timeout_s=30)
        [before] = await client.score("tests.reward_fns:pid", [item("a")])
        pool_pids = {p.pid for p in svc.pool._procs}
        forked = [p for p in descendants(os.getpid()) if b"multiprocessing.forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
        servers = [p for p in forked if p not in pool_pids]  # its children carry its command line too
        assert servers and before.value in pool_pids
        for pid in servers:
            os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(wait_until, "the fork server gone", lambda: not any(map(alive, servers)), timeout_s=30)
        for _ in range(2):
            [after] = await client.score("tests.reward_fns:pid", [item("a")])
            assert (after.status, after.value) == ("ok", before.value)
        assert svc.pool.restarts == 0


async def test_importing_a_function_is_not_on_its_first_items_clock(nats_url: str, nc: NATS) -> None:
    # a package pattern: its modules are not imported at process start, each process imports the
    # function's module when it first gets it (1.5 s here), which must not time out a 0.5 s item
    settings = RewardSettings(run=RUN, nats_url=nats_url, processes=2, allow=["tests.*:*"])
    async with running_reward(settings, nc) as svc:
        client = RewardClient(nc, timeout_s=60)
        results = await client.score("tests.reward_slow_import:length", [item("a"), item("bb")], item_timeout_s=0.5)
        assert [(r.status, r.value) for r in results] == [("ok", 1.0), ("ok", 2.0)], results
        assert svc.pool.restarts == 0


async def test_function_errors_are_reported_per_item(service: RewardService, nc: NATS) -> None:
    client = RewardClient(nc, timeout_s=20)
    raised = await client.score("tests.reward_fns:raises", [item("a")])
    assert raised[0].status == "error" and "KeyError" in raised[0].message
    text = await client.score("tests.reward_fns:returns_text", [item("a")])
    assert text[0].status == "error" and "expected a float" in text[0].message


async def test_functions_off_the_allow_list_are_refused(service: RewardService, nc: NATS) -> None:
    client = RewardClient(nc, timeout_s=20)
    with pytest.raises(RewardRequestError, match="'os:system' is not on this reward service's allow-list"):
        await client.score("os:system", [item("rm -rf /")])
    with pytest.raises(RewardRequestError, match="has no attribute 'missing'"):
        await client.score("tests.reward_fns:missing", [item("a")])
    with pytest.raises(RewardRequestError, match="module:function"):
        await client.score("not a reference", [item("a")])
    assert (await client.score("tests.reward_fns:length", [item("abc")]))[0].value == 3.0


async def test_malformed_request_bytes_get_an_error_reply(service: RewardService, nc: NATS) -> None:
    for payload in (b"\xc1 not msgpack", b"\x93\x01\x02\x03", b"\x81\xa2fn\xa1x"):
        msg = await nc.request(REWARD_SUBJECT, payload, timeout=10)
        reply = decode(RewardReply, msg.data)
        assert reply.error.startswith("malformed reward request") and not reply.results
        assert msg.headers and msg.headers.get("Nats-Service-Error-Code") == "400"
    client = RewardClient(nc, timeout_s=20)
    assert (await client.score("tests.reward_fns:length", [item("ab")]))[0].value == 2.0
    assert service.metrics.counters["malformed_messages"] == 3


async def test_metrics_are_published(service: RewardService, nc: NATS) -> None:
    events: asyncio.Queue[MetricsEvent] = asyncio.Queue()

    async def on_metrics(msg) -> None:  # type: ignore[no-untyped-def]
        await events.put(decode(MetricsEvent, msg.data))

    await nc.subscribe(Subjects(RUN).metrics("reward"), cb=on_metrics)
    stop = asyncio.Event()
    loop = asyncio.create_task(service.metrics_loop(stop))
    client = RewardClient(nc, timeout_s=20)
    try:
        await client.score("tests.reward_fns:sleepy", [item("a", sleep_s=0), item("b", sleep_s=30)], item_timeout_s=0.3)
        await client.score("tests.reward_fns:exit_now", [item("a")])
        while True:
            event = await asyncio.wait_for(events.get(), timeout=10)
            if event.values.get("items", 0) >= 3:
                break
    finally:
        stop.set()
        await loop
    values = event.values
    assert event.service == "reward" and event.worker == service.instance
    assert values["timeouts"] == 1 and values["errors"] == 1 and values["items_ok"] == 1
    assert values["pool_restarts"] == 2
    for key in ("items_per_s", "latency_p50_s", "latency_p99_s"):
        assert key in values


async def test_client_without_a_service_says_so(nc: NATS) -> None:
    client = RewardClient(nc, timeout_s=5)
    with pytest.raises(RewardUnavailableError, match="no reward service is listening"):
        await client.score("services.reward.builtin:copy3", [item("1", answer="1")])


async def test_ready_once_started_and_check_gone_after_stop(service: RewardService) -> None:
    name = f"reward:{service.instance}"
    assert (await evaluate_checks())[name]["ok"] is True
    await service.stop(timeout_s=1.0)
    assert name not in await evaluate_checks()


async def test_extra_processes_serve_items_behind_slow_ones_and_stop_when_idle(nats_url: str, nc: NATS) -> None:
    settings = RewardSettings(
        run=RUN, nats_url=nats_url, processes=1, allow=["tests.reward_fns:*"], slow_item_s=0.2, max_extra_processes=2
    )
    async with running_reward(settings, nc) as svc:
        client = RewardClient(nc, timeout_s=60)
        hanging = asyncio.create_task(
            client.score("tests.reward_fns:sleepy", [item("a", sleep_s=600), item("b", sleep_s=600)], item_timeout_s=10)
        )
        await asyncio.to_thread(wait_until, "both hanging items running", lambda: svc.pool.busy == 2, timeout_s=30, ignore=(RuntimeError,))
        good = await client.score("tests.reward_fns:length", [item("abc")])
        assert [(r.status, r.value) for r in good] == [("ok", 3.0)] and not hanging.done()
        assert [r.status for r in await hanging] == ["timeout", "timeout"]
        # both hanging items ran at once (the second in an extra process), then the good item got a
        # third one; the extras stop once idle, the pool is back to its size
        assert svc.pool.extra_started == 2 and svc.pool.size == 1
