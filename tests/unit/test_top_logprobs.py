"""Top log-probs end to end without a server: the CPU server's top-N per sampled token, its SGLang reply
shape, and the client's payload and parsing (SGLang's `top_logprobs_num` / `output_top_logprobs`)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from schemas.sglang_protocol import ProtocolError, build_generate_payload, parse_generate_reply
from services.inference.replies import output_body
from services.inference.requests import RequestError, SamplingParams, parse_generate
from services.inference.sampling import sample_top
from services.inference.scheduler import Seq


def parse(body: dict) -> SamplingParams:
    return parse_generate(body, vocab_size=48, context_length=1024, tokenize=None).params


def test_top_n_is_sorted_holds_the_sampled_token_and_is_a_distribution() -> None:
    logits = torch.randn(4, 48, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.7, top_logprobs_num=5), SamplingParams(temperature=0.0, top_logprobs_num=3),
              SamplingParams(temperature=1.3, top_logprobs_num=20), SamplingParams(top_logprobs_num=0)]
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed + k) for k in range(4)]
        tokens, logps, tops = sample_top(logits, params, gens)
        assert tops[3] is None
        for row, n in enumerate((5, 3, 20)):
            top = tops[row]
            assert top is not None and len(top) == n and len({t for _, t in top}) == n
            values = [lp for lp, _ in top]
            assert values == sorted(values, reverse=True)
            assert sum(math.exp(v) for v in values) <= 1 + 1e-6
            by_token = dict((t, lp) for lp, t in top)
            if logps[row] >= values[-1]:  # the sampled token ranks in the top N: it is there, same logprob
                assert by_token[tokens[row]] == pytest.approx(logps[row], abs=1e-6)
        assert tops[1] is not None and tops[1][0][1] == tokens[1]  # greedy: the argmax comes first


def test_tokens_the_filters_removed_are_not_reported() -> None:
    logits = torch.randn(1, 48, generator=torch.Generator().manual_seed(4))
    _, _, [top] = sample_top(logits, [SamplingParams(top_k=2, top_logprobs_num=5)], [torch.Generator().manual_seed(0)])
    assert top is not None and len(top) == 2 and sum(math.exp(lp) for lp, _ in top) == pytest.approx(1.0)


def test_request_field_is_top_level_bounded_and_needs_return_logprob() -> None:
    assert parse({"input_ids": [1], "return_logprob": True, "top_logprobs_num": 3}).top_logprobs_num == 3
    assert parse({"input_ids": [1], "top_logprobs_num": 3}).top_logprobs_num == 0
    with pytest.raises(RequestError, match=r"top_logprobs_num must be in 0\.\.20"):
        parse({"input_ids": [1], "return_logprob": True, "top_logprobs_num": 21})
    with pytest.raises(RequestError, match="unknown field"):
        parse({"input_ids": [1], "sampling_params": {"top_logprobs_num": 2}})


def test_reply_carries_sglang_triples_per_position() -> None:
    seq = Seq(sid=0, rid="r", prompt=[1], params=SamplingParams(top_logprobs_num=2), output_ids=[5, 6], logprobs=[-0.5, -2.0],
              top_logprobs=[[(-0.5, 5), (-1.5, 9)], None], versions=["0", "0"], prefilled=True)
    backend = SimpleNamespace(decode_text=lambda ids, skip: None)
    meta = output_body(seq, backend, return_logprob=True, server_version="0")["meta_info"]
    assert meta["output_top_logprobs"] == [[[-0.5, 5, None], [-1.5, 9, None]], [[-2.0, 6, None]]]
    plain = Seq(sid=1, rid="p", prompt=[1], params=SamplingParams(), output_ids=[5], logprobs=[-0.5], top_logprobs=[None],
                versions=["0"], prefilled=True)
    assert output_body(plain, backend, return_logprob=True, server_version="0")["meta_info"]["output_top_logprobs"] is None


def test_client_asks_and_parses_top_logprobs() -> None:
    assert build_generate_payload([1], max_new_tokens=2, top_logprobs_num=3)["top_logprobs_num"] == 3
    assert "top_logprobs_num" not in build_generate_payload([1], max_new_tokens=2)
    meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]],
            "output_top_logprobs": [[[-0.1, 7, None], [-3.0, 2, None]], [[-0.05, 4, "x"], [-0.2, 8, None]]]}
    part = parse_generate_reply({"output_ids": [7, 8], "meta_info": meta})
    assert part.output_top_logprobs == [[(7, -0.1), (2, -3.0)], [(4, -0.05), (8, -0.2)]]
    assert parse_generate_reply({"output_ids": [7, 8], "meta_info": {**meta, "output_top_logprobs": None}}).output_top_logprobs == []
    with pytest.raises(ProtocolError, match="1 positions for 2 output tokens"):
        parse_generate_reply({"output_ids": [7, 8], "meta_info": {**meta, "output_top_logprobs": [[]]}})
