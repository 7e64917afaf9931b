"""The rollout's reward client against a real reward service and nats-server: the score calls of one
event-loop turn reach the service as one request and each caller still gets its own results, in order;
a refused or oversized combined request is sent again call by call, so no call fails for another's
sake."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from schemas.messages import RewardItem
from services.reward.client import RewardClient, RewardRequestError, RewardUnavailableError
from services.reward.service import RewardService
from services.reward.settings import RewardSettings
from services.rollout.reward_batching import CoalescingRewardClient
from tests.support.reward import running_reward

LENGTH = "tests.reward_fns:length"


def items(*completions: str) -> list[RewardItem]:
    return [RewardItem(prompt="q", completion=c) for c in completions]


def group(g: int) -> list[RewardItem]:
    """Eight items whose rewards (their lengths) say which group and sample they are: 100 g + s."""
    return items(*("x" * (100 * g + s) for s in range(8)))


@pytest.fixture
async def service(nats_url: str, nc: NATS) -> AsyncIterator[RewardService]:
    settings = RewardSettings(run="rwbatch", nats_url=nats_url, processes=1, allow=["tests.reward_fns:*"], max_items=20)
    async with running_reward(settings, nc) as svc:
        yield svc


async def test_one_turns_calls_are_one_request_and_each_caller_gets_its_own_results(service: RewardService, nc: NATS) -> None:
    client = CoalescingRewardClient(RewardClient(nc, timeout_s=20))
    got = await asyncio.gather(*(client.score(LENGTH, group(g)[:2]) for g in range(1, 9)))
    assert [[r.value for r in results] for results in got] == [[100.0 * g, 100.0 * g + 1] for g in range(1, 9)]
    assert service.stats.totals["requests"] == 1 and service.stats.totals["items"] == 16
    assert (client.requests, client.calls) == (1, 8)
    # calls of different turns are requests of their own
    for g in (1, 2):
        assert [r.value for r in await client.score(LENGTH, group(g)[:1])] == [100.0 * g]
    assert service.stats.totals["requests"] == 3


async def test_a_batch_is_at_most_max_items(service: RewardService, nc: NATS) -> None:
    client = CoalescingRewardClient(RewardClient(nc, timeout_s=20), max_items=16)
    got = await asyncio.gather(*(client.score(LENGTH, group(g)) for g in range(1, 6)))
    assert [[r.value for r in results] for results in got] == [[100.0 * g + s for s in range(8)] for g in range(1, 6)]
    assert service.stats.totals["requests"] == 3  # 8 + 8, 8 + 8, 8


async def test_a_combined_request_the_service_refuses_is_sent_call_by_call(service: RewardService, nc: NATS) -> None:
    # our batches may hold 1024 items; this service takes 20: three groups of 8 are refused together, taken alone
    client = CoalescingRewardClient(RewardClient(nc, timeout_s=20))
    got = await asyncio.gather(*(client.score(LENGTH, group(g)) for g in range(1, 4)))
    assert [[r.value for r in results] for results in got] == [[100.0 * g + s for s in range(8)] for g in range(1, 4)]
    assert service.stats.totals["requests_refused"] == 1 and service.stats.totals["requests"] == 3
    assert client.split == 1
    # a refusal that is each call's own (a function not allowed) reaches every caller; others of the turn are scored
    refused = client.score("os:system", items("a"))
    other = client.score(LENGTH, items("abc"))
    results = await asyncio.gather(refused, client.score("os:system", items("b")), other, return_exceptions=True)
    assert all(isinstance(r, RewardRequestError) and "os:system" in str(r) for r in results[:2])
    assert [r.value for r in results[2]] == [3.0]


async def test_a_combined_request_too_large_for_nats_is_sent_call_by_call(service: RewardService, nc: NATS) -> None:
    client = CoalescingRewardClient(RewardClient(nc, timeout_s=20))
    size = nc.max_payload // 3  # each call fits, the three together do not
    got = await asyncio.gather(*(client.score(LENGTH, items("y" * (size - k))) for k in range(3)))
    assert [results[0].value for results in got] == [float(size - k) for k in range(3)]
    assert client.split == 1 and service.stats.totals["requests"] == 3


async def test_a_cancelled_caller_leaves_the_others_their_results(service: RewardService, nc: NATS) -> None:
    client = CoalescingRewardClient(RewardClient(nc, timeout_s=20))
    first = asyncio.ensure_future(client.score("tests.reward_fns:sleepy", [RewardItem(prompt="q", completion="ab", data={"sleep_s": 0.3})]))
    second = asyncio.ensure_future(client.score("tests.reward_fns:sleepy", items("abcd")))
    await asyncio.sleep(0)  # both calls are in the batch
    first.cancel()
    assert [r.value for r in await second] == [4.0]
    assert first.cancelled()


async def test_no_service_answering_reaches_every_caller(nc: NATS) -> None:
    client = CoalescingRewardClient(RewardClient(nc, timeout_s=2))
    results = await asyncio.gather(*(client.score(LENGTH, items("a")) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, RewardUnavailableError) for r in results)
    assert client.requests == 1
