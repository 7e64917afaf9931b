"""Top log-probs through the `SGLangClient` against the real CPU server (or real SGLang, as in the
contract tests): one list per output token, also when a pause splits the generation into passes."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.engine import ModelRequest, ModelResponse, SGLangClient
from tests.integration import test_inference_contract as contract
from tests.integration.test_inference_contract import PROMPTS, Target, wait_running

target, engine = contract.target, contract.engine


def assert_greedy_top(res: ModelResponse, n: int, length: int) -> None:
    ids, logprobs, tops = res.output_ids, res.output_logprobs, res.output_top_logprobs
    assert len(ids) == length and len(tops) == length
    for tok, lp, top in zip(ids, logprobs, tops, strict=True):
        assert len(top) == n and len({t for t, _ in top}) == n
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][0] == tok and top[0][1] == pytest.approx(lp, abs=1e-5)  # greedy: the sampled token leads


async def test_top_logprobs_per_token_and_none_unless_asked(engine: SGLangClient) -> None:
    res = await engine.agenerate(ModelRequest(PROMPTS[0], max_new_tokens=8, temperature=0.0, ignore_eos=True, top_logprobs=3))
    assert_greedy_top(res, 3, 8)
    plain = await engine.agenerate(ModelRequest(PROMPTS[0], max_new_tokens=8, temperature=0.0, ignore_eos=True))
    assert plain.output_top_logprobs == [] and plain.output_ids == res.output_ids


async def test_top_logprobs_are_concatenated_across_aborted_passes(engine: SGLangClient, target: Target) -> None:
    req = ModelRequest(PROMPTS[3], max_new_tokens=300, temperature=0.0, ignore_eos=True, top_logprobs=2)
    task = asyncio.create_task(engine.agenerate(req))
    try:
        await wait_running(target.url, task)
        await engine.pause()
    finally:
        await engine.resume()
    res = await task
    assert res.passes >= 2
    assert_greedy_top(res, 2, 300)
