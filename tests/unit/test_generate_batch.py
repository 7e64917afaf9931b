"""The batched `/generate` forms, as SGLang normalizes them, on the CPU server's request parser; and
the engine's batch payload built from single passes."""

from __future__ import annotations

from typing import Any

import pytest

from schemas.sglang_protocol import (
    ProtocolError,
    build_batch_payload,
    build_generate_payload,
    split_batch_reply,
)
from services.inference.requests import RequestError, parse_generate


def parse(body: dict[str, Any]) -> Any:
    return parse_generate(body, vocab_size=48, context_length=1024, tokenize=None)


def test_sampling_params_may_be_one_per_input() -> None:
    gen = parse({"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 3, "sampling_seed": 5}, {"max_new_tokens": 7}],
                 "return_logprob": [True, False], "top_logprobs_num": [2, 2]})
    assert [p.max_new_tokens for p in gen.param_list] == [3, 7]
    assert [p.seed for p in gen.param_list] == [5, None]
    assert gen.return_logprobs == [True, False]
    assert [p.top_logprobs_num for p in gen.param_list] == [2, 0]  # top log-probs only with return_logprob


def test_one_sampling_object_serves_every_input() -> None:
    gen = parse({"input_ids": [[1, 2], [3], [4]], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True})
    assert [p.max_new_tokens for p in gen.param_list] == [2, 2, 2] and gen.return_logprobs == [True] * 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params has 1 entries for a batch of 2 inputs"),
        ({"input_ids": [1, 2], "sampling_params": [{}]}, "sampling_params is a list, but the request is not a batch"),
        ({"input_ids": [[1], [2]], "return_logprob": [True]}, "return_logprob has 1 entries"),
        ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "parallel_sample_num should be the same"),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "Duplicate request IDs"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {"max_new_tokens": 2000}]}, "maximum context length"),
        ({"input_ids": [[1], [2, 99]]}, "input_ids[1]: token id 99 is out of vocabulary"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {"bogus": 1}]}, "unknown field(s) bogus"),
    ],
)
def test_a_bad_batch_is_refused_naming_what_is_wrong(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as info:
        parse(body)
    assert message in str(info.value)


def test_a_string_rid_names_a_batchs_requests_as_sglang_does() -> None:
    assert parse({"input_ids": [[1], [2]], "rid": "g"}).rids == ["g_0", "g_1"]
    assert parse({"input_ids": [1], "rid": "g"}).rids == ["g"]


def test_repeated_sampling_settings_parse_to_the_same_params() -> None:
    raw = {"max_new_tokens": 4, "temperature": 0.7, "top_k": 5}
    first, again = parse({"input_ids": [1], "sampling_params": raw}).params, parse({"input_ids": [1], "sampling_params": dict(raw)}).params
    assert first == again and first.temperature == 0.7
    with pytest.raises(RequestError, match="top_k must be -1"):
        parse({"input_ids": [1], "sampling_params": {**raw, "top_k": 0}})
    stop = parse({"input_ids": [1], "sampling_params": {**raw, "stop_token_ids": [3, 4]}}).params  # a list value
    assert stop.stop_token_ids == frozenset({3, 4})


def test_the_engine_batch_payload_is_the_single_payloads_side_by_side() -> None:
    singles = [build_generate_payload([1, 2 + i], max_new_tokens=4, seed=i, rid=f"r{i}") for i in range(3)]
    body = build_batch_payload(singles)
    assert body["input_ids"] == [[1, 2], [1, 3], [1, 4]] and body["rid"] == ["r0", "r1", "r2"]
    assert [s["sampling_seed"] for s in body["sampling_params"]] == [0, 1, 2]
    assert body["return_logprob"] is True and body["stream"] is False
    gen = parse(body)  # the CPU server reads it back as three requests with their own settings
    assert gen.prompts == [[1, 2], [1, 3], [1, 4]] and [p.seed for p in gen.param_list] == [0, 1, 2] and gen.rids == ["r0", "r1", "r2"]
    with pytest.raises(ValueError, match="cannot batch"):
        build_batch_payload([singles[0], build_generate_payload([1], max_new_tokens=4, top_logprobs_num=2, rid="x")])
    with pytest.raises(ProtocolError, match="2 outputs for 3 inputs"):
        split_batch_reply([{}, {}], 3)
    with pytest.raises(ProtocolError, match="expected a list"):
        split_batch_reply({"meta_info": {}}, 3)
