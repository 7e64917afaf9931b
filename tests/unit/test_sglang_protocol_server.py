"""The CPU server's side of the protocol without a server: request validation, version spans, sampling."""

from __future__ import annotations

import pytest
import torch

from services.inference.replies import version_spans
from services.inference.requests import RequestError, SamplingParams, parse_generate
from services.inference.sampling import sample


def parse(body: dict, **kw: object):
    return parse_generate(body, vocab_size=48, context_length=64, tokenize=kw.get("tokenize"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "Either text or input_ids"),
        ({"text": "a", "input_ids": [1]}, "Either text or input_ids"),
        ({"input_ids": [1, 48]}, "out of vocabulary"),
        ({"input_ids": [1, -1]}, "out of vocabulary"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be >= 0"),
        ({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 60}}, "of 64 tokens. You requested a total of 70"),
        # SGLang's rule: an input as long as the context is refused even with max_new_tokens 0
        ({"input_ids": [1] * 64, "sampling_params": {"max_new_tokens": 0}}, r"The input \(64 tokens\) is longer than the model's context"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "unknown field"),
        ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.5}}, "not supported"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 2.5}}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"input_ids": [1], "sampling_params": {"logit_bias": {"48": 1.0}}}, r"logit_bias must has keys in \[0, 47\]"),
        ({"text": "abc"}, "needs a tokenizer"),
    ],
)
def test_bad_requests_name_the_problem(body: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        parse(body)


def test_batch_input_and_n_expand() -> None:
    gen = parse({"input_ids": [[1, 2], [3]], "sampling_params": {"n": 2, "max_new_tokens": 3}, "rid": ["a", "b"]})
    assert gen.prompts == [[1, 2], [1, 2], [3], [3]] and gen.batched and gen.rids == ["a-0", "a-1", "b-0", "b-1"]
    single = parse({"input_ids": [4, 5], "sampling_params": {"sampling_seed": 3, "stop": "x", "max_new_tokens": 4}})
    assert not single.batched and single.params.seed == 3 and single.params.stop == ("x",)


def test_version_spans_are_end_exclusive_runs() -> None:
    assert version_spans(["0", "0", "1"]) == [{"version": "0", "start": 0, "end": 2}, {"version": "1", "start": 2, "end": 3}]
    assert version_spans([]) == []


def test_seeded_sampling_reproducible_and_logprobs_use_temperature() -> None:
    logits = torch.randn(3, 48, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=0.7, seed=5)
    draws = [sample(logits, [p] * 3, [torch.Generator().manual_seed(5) for _ in range(3)]) for _ in range(2)]
    assert draws[0] == draws[1]
    toks, lps = draws[0]
    expected = torch.log_softmax(logits / 0.7, dim=-1)
    for i, (t, lp) in enumerate(zip(toks, lps, strict=True)):
        assert lp == pytest.approx(expected[i, t].item(), abs=1e-6)


def test_top_k_and_top_p_restrict_and_renormalise() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0] + [-10.0] * 44])
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    seen = {sample(logits, [SamplingParams(top_k=2)], [g])[0][0] for g in gens}
    assert seen == {0, 1}
    tok, lp = sample(logits, [SamplingParams(top_p=0.5)], [torch.Generator().manual_seed(0)])
    assert tok == [0] and lp[0] == pytest.approx(0.0, abs=1e-6)  # nucleus of one token: probability 1


def test_greedy_takes_argmax_with_its_plain_logprob() -> None:
    logits = torch.randn(2, 48, generator=torch.Generator().manual_seed(2))
    toks, lps = sample(logits, [SamplingParams(temperature=0.0)] * 2, [torch.Generator()] * 2)
    assert toks == logits.argmax(-1).tolist()
    assert lps == pytest.approx(torch.log_softmax(logits, -1).max(-1).values.tolist(), abs=1e-6)
