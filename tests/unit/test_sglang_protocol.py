"""The client's pure SGLang payload/reply functions: every reply shape the server can send."""

from __future__ import annotations

import pytest

from schemas.sglang_protocol import (
    ProtocolError,
    build_generate_payload,
    error_message,
    parse_generate_reply,
    parse_version,
)


def reply(ids: list[int], finish: dict, *, version: str = "3", spans: list | None = None, logprobs: bool = True) -> dict:
    meta = {"id": "r", "finish_reason": finish, "weight_version": version, "prompt_tokens": 2, "completion_tokens": len(ids)}
    if logprobs:
        meta["output_token_logprobs"] = [[-0.1 * (i + 1), t, None] for i, t in enumerate(ids)]
    if spans is not None:
        meta["weight_versions"] = spans
    return {"text": "x", "output_ids": ids, "meta_info": meta}


def test_payload_carries_ids_sampling_and_logprob_request() -> None:
    p = build_generate_payload([1, 2], max_new_tokens=5, temperature=0.5, top_k=3, stop_token_ids=[9], seed=7, rid="a")
    assert p["input_ids"] == [1, 2] and p["return_logprob"] is True and p["stream"] is False and p["rid"] == "a"
    sp = p["sampling_params"]
    assert sp == {"max_new_tokens": 5, "temperature": 0.5, "top_p": 1.0, "top_k": 3, "ignore_eos": False,
                  "stop_token_ids": [9], "sampling_seed": 7}


def test_payload_omits_unset_optional_fields() -> None:
    sp = build_generate_payload([1], max_new_tokens=1)["sampling_params"]
    assert "sampling_seed" not in sp and "stop" not in sp and "stop_token_ids" not in sp


def test_parse_tokens_logprobs_and_version() -> None:
    part = parse_generate_reply(reply([5, 6], {"type": "length", "length": 2}))
    assert part.output_ids == [5, 6]
    assert part.output_logprobs == pytest.approx([-0.1, -0.2])
    assert part.output_versions == [3, 3]
    assert part.finished and part.finish_type == "length"


def test_parse_version_spans_override_the_single_version() -> None:
    spans = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 3}]
    part = parse_generate_reply(reply([5, 6, 7], {"type": "stop", "matched": 7}, version="2", spans=spans))
    assert part.output_versions == [1, 1, 2]


def test_abort_before_prefill_shape_is_an_empty_unfinished_pass() -> None:
    body = {"text": "", "output_ids": [], "meta_info": {"id": "r", "finish_reason": {"type": "abort", "message": "Abort before prefill"},
                                                       "prompt_tokens": 0, "completion_tokens": 0}}
    part = parse_generate_reply(body)
    assert part.output_ids == [] and part.output_logprobs == [] and not part.finished
    assert part.finish_type == "abort" and part.finish_message == "Abort before prefill"


def test_abort_with_partial_tokens_keeps_them() -> None:
    part = parse_generate_reply(reply([4], {"type": "abort", "message": "paused", "status_code": 200}))
    assert part.output_ids == [4] and not part.finished and part.status_code == 200


def test_tokens_without_logprobs_are_refused() -> None:
    with pytest.raises(ProtocolError, match="no output_token_logprobs"):
        parse_generate_reply(reply([4, 5], {"type": "stop"}, logprobs=False))


@pytest.mark.parametrize("body", [[], {"meta_info": {}}, {"meta_info": {"finish_reason": None}}, {"error": {"message": "bad"}}])
def test_malformed_replies_raise(body: object) -> None:
    with pytest.raises(ProtocolError):
        parse_generate_reply(body)


def test_versions_default_means_zero_and_garbage_is_named() -> None:
    assert parse_version("default") == 0 and parse_version(None) == 0 and parse_version("12") == 12 and parse_version(4) == 4
    with pytest.raises(ProtocolError, match="'v2'"):
        parse_version("v2")


def test_error_message_reads_sglang_error_shape() -> None:
    assert error_message({"error": {"message": "too long"}}, "fb") == "too long"
    assert error_message("<html>", "fb") == "fb"
