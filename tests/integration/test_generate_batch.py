"""A group's samples go to the inference server as one batched `/generate` (SGLang's list form), and
each caller still gets exactly its own sample, its own error, its own retry and failover.

The CPU server (`jetrl inference`, tiny model) runs as a real process; the count of HTTP requests is
the server's own (`generate_calls` in `/server_info`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import BadRequestError, InferenceEngine, ModelRequest, ModelResponse
from tests.support.inference import ServerProcess, free_port, running_servers

PROMPT = [1, 5, 6, 7, 13]
GROUP = 8


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_servers(tiny_model, tmp_path_factory.mktemp("batch"), 1, "skip_tokenizer_init=true") as (s,):
        yield s


def engine_for(*servers: str, batch: bool = True) -> InferenceEngine:
    return InferenceEngine(InferenceClientSettings(servers=list(servers), batch_generate=batch, max_retries=0,
                                                   backoff_initial_s=0.01, connect_timeout_s=2.0))


@pytest.fixture
async def engine(server: ServerProcess) -> AsyncIterator[InferenceEngine]:
    eng = engine_for(server.url)
    yield eng
    await eng.aclose()


async def generate_calls(url: str) -> int:
    async with httpx.AsyncClient() as http:
        return int((await http.get(url + "/server_info")).json()["generate_calls"])


def group(seed: int = 100) -> list[ModelRequest]:
    return [ModelRequest(list(PROMPT), max_new_tokens=6, ignore_eos=True, seed=seed + i) for i in range(GROUP)]


async def test_a_group_of_eight_samples_is_one_http_request(server: ServerProcess, engine: InferenceEngine) -> None:
    before = await generate_calls(server.url)
    out = await asyncio.gather(*(engine.agenerate(r, episode="e1") for r in group()))
    assert await generate_calls(server.url) - before == 1
    assert all(len(r.output_ids) == 6 and len(r.output_logprobs) == 6 and r.server == server.url for r in out)
    unbatched = engine_for(server.url, batch=False)
    try:
        before = await generate_calls(server.url)
        await asyncio.gather(*(unbatched.agenerate(r) for r in group()))
        assert await generate_calls(server.url) - before == GROUP  # the switch turns it off
    finally:
        await unbatched.aclose()


async def test_batched_samples_are_the_samples_each_request_gets_alone(server: ServerProcess, engine: InferenceEngine) -> None:
    batched = await asyncio.gather(*(engine.agenerate(r) for r in group(seed=7)))
    alone: list[ModelResponse] = [await engine.agenerate(r) for r in group(seed=7)]  # one at a time: no batch
    for b, a in zip(batched, alone, strict=True):
        assert b.output_ids == a.output_ids
        assert b.output_versions == a.output_versions
        assert b.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-4)
        assert b.stop_reason == a.stop_reason
    assert len({tuple(b.output_ids) for b in batched}) > 1  # the seeds differ, so do the samples


async def test_a_bad_sample_fails_alone_and_the_rest_of_its_batch_succeeds(server: ServerProcess, engine: InferenceEngine) -> None:
    reqs = group()
    reqs[3] = ModelRequest([1, 5, 10_000], max_new_tokens=6, ignore_eos=True, seed=3)  # out of the tiny model's vocabulary
    before = await generate_calls(server.url)
    out = await asyncio.gather(*(engine.agenerate(r) for r in reqs), return_exceptions=True)
    assert isinstance(out[3], BadRequestError) and "10000" in str(out[3])
    good = [r for i, r in enumerate(out) if i != 3]
    assert all(isinstance(r, ModelResponse) and len(r.output_ids) == 6 for r in good)
    assert await generate_calls(server.url) - before == 1 + GROUP  # the refused batch, then each pass alone
    assert engine.batcher.split == 1


async def test_a_batch_fails_over_to_the_next_server(server: ServerProcess) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    eng = engine_for(dead, server.url)
    try:
        before = await generate_calls(server.url)
        out = await asyncio.gather(*(eng.agenerate(r, episode="g") for r in group()))
        assert all(r.server == server.url and len(r.output_ids) == 6 for r in out)
        assert await generate_calls(server.url) - before == 1
    finally:
        await eng.aclose()


async def test_samples_aborted_by_a_weight_update_are_continued_together(
    server: ServerProcess, engine: InferenceEngine, tiny_model: Path
) -> None:
    from schemas.sglang_protocol import parse_version
    from services.rollout.engine import WeightUpdateMeta

    async with httpx.AsyncClient() as http:
        v0 = parse_version((await http.get(server.url + "/model_info")).json()["weight_version"])
    reqs = [ModelRequest(list(PROMPT), max_new_tokens=300, ignore_eos=True, seed=i) for i in range(GROUP)]
    before = await generate_calls(server.url)
    tasks = asyncio.gather(*(engine.agenerate(r) for r in reqs))
    async with httpx.AsyncClient() as http:  # until the batch runs, so the pause aborts it mid-generation
        for _ in range(3000):
            if (await http.get(server.url + "/v1/loads")).json()["loads"][0]["num_running_reqs"] > 0:
                break
            await asyncio.sleep(0.01)
    await engine.update_weights(WeightUpdateMeta(path=str(tiny_model), version=v0 + 1))
    out = await tasks
    for r in out:
        assert len(r.output_ids) == 300 and r.output_versions == sorted(r.output_versions)
        assert r.output_versions[-1] == v0 + 1
    passes = sum(r.passes for r in out)
    assert passes >= 2 * GROUP  # every sample was aborted and continued ...
    assert await generate_calls(server.url) - before < passes  # ... in batches, not one request per pass


async def test_a_cancelled_sample_leaves_the_rest_of_its_batch_running(server: ServerProcess, engine: InferenceEngine) -> None:
    tasks = [asyncio.create_task(engine.agenerate(r)) for r in group(seed=300)]
    await asyncio.sleep(0)  # every pass is queued in the batcher (one event-loop turn)
    tasks[5].cancel()
    out = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(out[5], asyncio.CancelledError)
    assert all(isinstance(r, ModelResponse) and len(r.output_ids) == 6 for i, r in enumerate(out) if i != 5)


async def test_server_info_counts_the_rows_of_every_model_call(server: ServerProcess, engine: InferenceEngine) -> None:
    """`forward_rows` is how the batching can be checked in a run: every generated token is one row of
    one model call, except that a group's shared prompt is computed once: a group of 8 arriving at once
    is prefilled in one call of one row (its logits give each sample its first token), then decoded in
    calls of 8 rows."""
    async with httpx.AsyncClient() as http:
        before = (await http.get(server.url + "/server_info")).json()
        await asyncio.gather(*(engine.agenerate(r) for r in group(500)))
        after = (await http.get(server.url + "/server_info")).json()

    def rows(info: dict) -> int:
        return sum(int(k) * n for calls in info["forward_rows"].values() for k, n in calls.items())

    assert after["tokens_generated"] - before["tokens_generated"] == GROUP * 6
    assert rows(after) - rows(before) == GROUP * 6 - (GROUP - 1)
    assert after["forward_rows"]["prefill"].get("1", 0) - before["forward_rows"]["prefill"].get("1", 0) == 1
    assert after["cpu_s"] > before["cpu_s"] > 0
