"""What jetrl's clients got wrong against current SGLang, each checked against the CPU server started as
jetrl starts SGLang (`skip_tokenizer_init`), which answers as SGLang 0.5.23 does: no
`/get_weight_version`, `stop` refused, the default cache flush refused while a pause holds requests,
`/health` waiting out a pause, and `/ready`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from services.common.health import http_check
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import InferenceEngine, InferenceError, ModelRequest
from services.weights.agent.server_client import READY_POLL_TIMEOUT_S, ServerClient, ServerError, readiness_urls
from tests.support.inference import ServerProcess, running_servers

PROMPT = [1, 5, 6, 7, 13]


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_servers(tiny_model, tmp_path_factory.mktemp("sglang-fixes"), 1, "skip_tokenizer_init=true",
                         "health_check_timeout_s=20") as (s,):
        yield s


@pytest.fixture
async def engine(server: ServerProcess) -> AsyncIterator[InferenceEngine]:
    eng = InferenceEngine(InferenceClientSettings(servers=[server.url], max_retries=1, backoff_initial_s=0.05))
    yield eng
    await eng.aclose()


async def wait_running(url: str, task: asyncio.Task) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(2000):
            if (await http.get(url + "/v1/loads")).json()["loads"][0]["num_running_reqs"] > 0 or task.done():
                return
            await asyncio.sleep(0.005)
    raise AssertionError("the request never started running")


async def test_engine_reads_the_weight_version_from_model_info(engine: InferenceEngine, server: ServerProcess) -> None:
    res = await engine.agenerate(ModelRequest(PROMPT, max_new_tokens=3, ignore_eos=True))
    assert res.output_versions == [await engine.get_weight_version(server.url)] * 3


async def test_stop_strings_are_applied_by_the_engine_not_sent_to_the_server(engine: InferenceEngine, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    decode = AutoTokenizer.from_pretrained(str(tiny_model)).decode
    free = await engine.agenerate(ModelRequest(PROMPT, max_new_tokens=24, temperature=0.0, ignore_eos=True))
    stop = decode(free.output_ids[4:6])
    res = await engine.agenerate(ModelRequest(PROMPT, max_new_tokens=24, temperature=0.0, ignore_eos=True, stop=["never", stop]))
    text = decode(res.output_ids)
    assert res.stop_reason == "stop" and res.stop_matched == stop
    assert text.endswith(stop) and stop not in decode(res.output_ids[:-1])  # kept through the match, not beyond
    assert res.output_ids == free.output_ids[: len(res.output_ids)] and len(res.output_logprobs) == len(res.output_ids)


async def test_in_place_pause_then_update_with_a_request_in_flight(
    engine: InferenceEngine, server: ServerProcess, tiny_model: Path, tmp_path: Path
) -> None:
    from services.inference.make_model import build_model

    new_weights = build_model(tmp_path / "seed1", seed=1)
    client = ServerClient(server.url, 60.0, "in_place")
    assert await client.wait_ready(30)
    v0 = await client.get_weight_version()
    try:
        task = asyncio.create_task(engine.agenerate(ModelRequest(PROMPT, max_new_tokens=300, ignore_eos=True)))
        await wait_running(server.url, task)
        await client.pause("in_place")
        try:
            await client.update_weights_from_disk(str(new_weights), v0 + 1)  # refused before: default flush
        finally:
            await client.resume()
        res = await task
        assert await client.get_weight_version() == v0 + 1
        assert res.passes == 1 and len(res.output_ids) == 300  # held in place, not aborted
        assert res.output_versions[0] == v0 and res.output_versions[-1] == v0 + 1
    finally:
        await client.pause("abort")
        await client.update_weights_from_disk(str(tiny_model), v0 + 2)
        await client.resume()
        await client.aclose()


async def test_readiness_holds_while_a_pause_makes_health_slow(server: ServerProcess) -> None:
    client = ServerClient(server.url, 60.0, "in_place")
    try:
        await client.pause("in_place")
        try:
            assert await http_check(*readiness_urls(server.url), timeout_s=READY_POLL_TIMEOUT_S)() is True
            assert await asyncio.wait_for(client.wait_ready(15), 20) is True
            with pytest.raises(ConnectionError, match="/health"):  # why /health alone flipped readiness
                await http_check(f"{server.url}/health")()
        finally:
            await client.resume()
    finally:
        await client.aclose()


async def test_a_server_too_old_fails_at_start_naming_version_and_feature(tmp_path: Path) -> None:
    with running_servers(None, tmp_path, 1, "simulate=true", "sglang_version=0.4.9") as (old,):
        client = ServerClient(old.url, 10.0)
        try:
            with pytest.raises(ServerError, match=r"SGLang 0\.4\.9.*weight_version"):
                await client.wait_ready(30)
        finally:
            await client.aclose()
        engine = InferenceEngine(InferenceClientSettings(servers=[old.url]))
        try:
            with pytest.raises(InferenceError, match=r"SGLang 0\.4\.9"):
                await engine.agenerate(ModelRequest([1, 2], max_new_tokens=2))
        finally:
            await engine.aclose()
    with running_servers(None, tmp_path, 1, "simulate=true", "sglang_version=0.5.18") as (mid,):
        client = ServerClient(mid.url, 10.0, "in_place")
        try:
            with pytest.raises(ServerError, match=r"SGLang 0\.5\.18.*>= 0\.5\.19.*per-token weight versions"):
                await client.wait_ready(30)
        finally:
            await client.aclose()
