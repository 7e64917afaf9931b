"""Contract tests of the `SGLangClient` client against an SGLang-protocol server.

By default the server is `jetrl inference` (CPU, tiny model) as a real process. Set `JETRL_SGLANG_URL`
to run the same tests against a real SGLang server (marker `sglang`; `JETRL_SGLANG_MODEL` = the local
model directory it serves enables the logprob-reference and weight-update checks).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import BadRequestError, ModelRequest, SGLangClient, WeightUpdateMeta
from tests.support.inference import reference_logprobs, running_servers

PROMPTS = [[1, 5, 6, 7, 13], [1, 9, 13], [1, 4, 4, 4, 4, 4, 4, 13], [1, 20, 21, 22, 23, 13], [1, 8], [1, 7, 7, 13]]


@dataclass
class Target:
    url: str
    model: Path | None
    """Model directory the server serves (for reference forward passes); None when unknown."""
    cpu: bool


@pytest.fixture(scope="module", params=["cpu", pytest.param("sglang", marks=pytest.mark.sglang)])
def target(request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    if request.param == "sglang":
        url = os.environ.get("JETRL_SGLANG_URL")
        if not url:
            pytest.skip("JETRL_SGLANG_URL not set: no real SGLang server to test against")
        model = os.environ.get("JETRL_SGLANG_MODEL")
        yield Target(url.rstrip("/"), Path(model) if model else None, cpu=False)
        return
    with running_servers(tiny_model, tmp_path_factory.mktemp("inference-logs")) as (server,):
        yield Target(server.url, tiny_model, cpu=True)


@pytest.fixture
async def engine(target: Target) -> SGLangClient:
    eng = SGLangClient(InferenceClientSettings(servers=[target.url], max_retries=1, backoff_initial_s=0.05))
    yield eng
    await eng.aclose()


async def running_requests(url: str) -> int:
    async with httpx.AsyncClient() as http:
        body = (await http.get(url + "/v1/loads")).json()
    return sum(int(r.get("num_running_reqs", 0)) for r in body["loads"])


async def wait_running(url: str, task: asyncio.Task) -> None:
    for _ in range(2000):
        if await running_requests(url) > 0 or task.done():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the request never started running")


async def test_greedy_is_deterministic_and_honours_max_new_tokens(engine: SGLangClient, target: Target) -> None:
    req = ModelRequest(PROMPTS[0], max_new_tokens=12, temperature=0.0, ignore_eos=True)
    a, b = await engine.agenerate(req), await engine.agenerate(req)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 12
    assert a.stop_reason == "length" and a.input_ids == PROMPTS[0] and a.server == target.url
    assert len(a.output_logprobs) == len(a.output_versions) == 12 and all(lp <= 0 for lp in a.output_logprobs)
    assert set(a.output_versions) == {await engine.get_weight_version(target.url)}


async def test_stop_token_ids_end_the_completion(engine: SGLangClient) -> None:
    free = await engine.agenerate(ModelRequest(PROMPTS[1], max_new_tokens=10, temperature=0.0, ignore_eos=True))
    stop_id = free.output_ids[3]
    cut = free.output_ids.index(stop_id) + 1
    assert not set(free.output_ids[:cut]) & {0, 1, 2}  # no special token (EOS) before the cut
    r = await engine.agenerate(ModelRequest(PROMPTS[1], max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_id]))
    assert r.stop_reason == "stop" and r.output_ids == free.output_ids[:cut]
    # SGLang's rule (`Req._check_token_based_finish` returns first): with ignore_eos no token ends it
    r = await engine.agenerate(ModelRequest(PROMPTS[1], max_new_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]))
    assert r.stop_reason == "length" and r.output_ids == free.output_ids


async def test_seeded_sampling_is_reproducible(engine: SGLangClient, target: Target) -> None:
    if not target.cpu and not os.environ.get("JETRL_SGLANG_DETERMINISTIC"):
        pytest.skip("SGLang honours sampling_seed only with --enable-deterministic-inference (JETRL_SGLANG_DETERMINISTIC=1)")
    req = ModelRequest(PROMPTS[2], max_new_tokens=16, temperature=1.0, ignore_eos=True, seed=1234)
    a, b = await asyncio.gather(engine.agenerate(req), engine.agenerate(req))
    other = await engine.agenerate(ModelRequest(PROMPTS[2], max_new_tokens=16, temperature=1.0, ignore_eos=True, seed=99))
    assert a.output_ids == b.output_ids and a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
    assert other.output_ids != a.output_ids


async def test_logprobs_match_a_reference_forward_pass(engine: SGLangClient, target: Target) -> None:
    if target.model is None:
        pytest.skip("JETRL_SGLANG_MODEL not set: no local copy of the served model for the reference pass")
    # Concurrent requests of different lengths are decoded in one batch: padding must not leak.
    reqs = [ModelRequest(p, max_new_tokens=20, temperature=0.8, ignore_eos=True, seed=i) for i, p in enumerate(PROMPTS)]
    results = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
    for req, res in zip(reqs, results, strict=True):
        ref = reference_logprobs(target.model, req.input_ids, res.output_ids, req.temperature)
        assert res.output_logprobs == pytest.approx(ref, abs=1e-4)


async def test_a_bad_request_raises_at_once_with_the_server_message(engine: SGLangClient) -> None:
    with pytest.raises(BadRequestError, match="vocab"):
        await engine.agenerate(ModelRequest([1, 10**6], max_new_tokens=4))


async def test_pause_update_continue_gives_one_completion_with_two_versions(
    engine: SGLangClient, target: Target, tmp_path: Path
) -> None:
    if target.model is None:
        pytest.skip("JETRL_SGLANG_MODEL not set: no checkpoint to load")
    if target.cpu:
        from services.inference.make_model import build_model

        new_weights = build_model(tmp_path / "seed1", seed=1)
    else:
        new_weights = target.model
    v0 = await engine.get_weight_version(target.url)
    prompt = PROMPTS[0]
    task = asyncio.create_task(engine.agenerate(ModelRequest(prompt, max_new_tokens=400, ignore_eos=True, seed=3)))
    try:
        await wait_running(target.url, task)
        await engine.pause()
        await engine.update_weights_from_disk(str(new_weights), v0 + 1)
        await engine.resume()
        res = await task
    finally:
        await engine.resume()
        await engine.update_weights_from_disk(str(target.model), v0 + 2)  # later tests expect the original weights
    assert len(res.output_ids) == 400 and res.stop_reason == "length" and res.passes >= 2
    assert res.output_versions[0] == v0 and res.output_versions[-1] == v0 + 1
    assert res.output_versions == sorted(res.output_versions)
    if target.cpu:  # the continuation really ran on the new weights
        switch = res.output_versions.index(v0 + 1)
        ref = reference_logprobs(new_weights, prompt, res.output_ids, 1.0)
        assert res.output_logprobs[switch:] == pytest.approx(ref[switch:], abs=1e-4)


async def test_update_weights_loads_a_checkpoint_and_never_leaves_the_server_paused(
    engine: SGLangClient, target: Target, tmp_path: Path
) -> None:
    # The AReaL-lite name of the research API (docs/design.md "Python API"), on the disk transport.
    if target.model is None or not target.cpu:
        pytest.skip("needs a checkpoint of the served model's shape to load")
    from services.inference.make_model import build_model

    new_weights = build_model(tmp_path / "seed2", seed=2)
    v0 = await engine.get_weight_version(target.url)
    short = ModelRequest(PROMPTS[1], max_new_tokens=4, ignore_eos=True)
    try:
        with pytest.raises(BadRequestError, match="update_weights_from_disk"):
            await engine.update_weights(WeightUpdateMeta(path=str(tmp_path / "missing"), version=v0 + 1))
        # resumed although the load failed: generation goes on, on the old weights
        kept = await asyncio.wait_for(engine.agenerate(short), 30)
        assert kept.output_versions == [v0] * 4

        await engine.update_weights(WeightUpdateMeta(path=str(new_weights), version=v0 + 1))
        assert await engine.get_weight_version(target.url) == v0 + 1
        after = await asyncio.wait_for(engine.agenerate(short), 30)
        assert after.output_versions == [v0 + 1] * 4
        ref = reference_logprobs(new_weights, short.input_ids, after.output_ids, 1.0)
        assert after.output_logprobs == pytest.approx(ref, abs=1e-4)  # served by the new weights
    finally:
        await engine.update_weights(WeightUpdateMeta(path=str(target.model), version=v0 + 2))  # later tests expect these


async def test_failover_when_a_server_dies_mid_request(target: Target, tiny_model: Path, tmp_path: Path) -> None:
    if not target.cpu:
        pytest.skip("needs a server this test may kill")
    with running_servers(tiny_model, tmp_path) as (victim,):
        # The module's server survives; the extra one is listed first, so round robin starts there.
        settings = InferenceClientSettings(servers=[victim.url, target.url], policy="round_robin", max_retries=1, backoff_initial_s=0.05)
        engine = SGLangClient(settings)
        try:
            short = ModelRequest(PROMPTS[1], max_new_tokens=2, ignore_eos=True)
            spread = [(await engine.agenerate(short)).server for _ in range(2)]
            sticky = {(await engine.agenerate(short, episode="ep")).server for _ in range(3)}
            assert spread == [victim.url, target.url] and sticky == {victim.url}  # round robin, one server per episode

            task = asyncio.create_task(engine.agenerate(ModelRequest(PROMPTS[0], max_new_tokens=400, ignore_eos=True), episode="ep"))
            await wait_running(victim.url, task)
            victim.stop(signal.SIGKILL)
            res = await task
            assert res.server == target.url and len(res.output_ids) == 400 and res.stop_reason == "length"
            assert (await engine.agenerate(short, episode="ep")).server == target.url
        finally:
            await engine.aclose()
