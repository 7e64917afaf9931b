"""Control messages: msgpack round trip, schema_version, and decode errors tied to one type."""

from __future__ import annotations

import msgpack
import pytest
from pydantic import ValidationError

from schemas.messages import (
    MessageError,
    MetricsEvent,
    PromptTask,
    RejectionMarker,
    RewardReply,
    RewardRequest,
    RewardResult,
    WeightFile,
    WeightsLoaded,
    WeightsPublished,
    decode,
    encode,
)

SAMPLES = [
    PromptTask(run="r", prompt_id="0-1", data={"prompt": "123=", "answer": "123", "n": [1, 2]}),
    RejectionMarker(run="r", prompt_id="0-1", worker="w", reason="all samples failed"),
    WeightsPublished(run="r", version=3, uri="file:///w/v3", files=[WeightFile(name="a", sha256="0" * 64, size=5)], step=3),
    WeightsLoaded(run="r", server="http://127.0.0.1:1", version=3, seconds=0.2),
    RewardRequest(fn="m:f", items=[]),
    RewardReply(results=[RewardResult(status="timeout"), RewardResult(status="ok", value=1.0)]),
    MetricsEvent(run="r", service="trainer", step=1, values={"loss": 0.5}),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg) -> None:  # type: ignore[no-untyped-def]
    data = encode(msg)
    assert decode(type(msg), data) == msg
    assert msgpack.unpackb(data)["schema_version"] == 1


def test_decoding_as_the_wrong_type_names_the_type() -> None:
    with pytest.raises(MessageError, match="PromptTask"):
        decode(PromptTask, encode(SAMPLES[3]))


def test_unknown_schema_version() -> None:
    raw = msgpack.packb({"schema_version": 7, "run": "r", "prompt_id": "p", "data": {}})
    with pytest.raises(MessageError, match="unsupported schema_version 7"):
        decode(PromptTask, raw)


@pytest.mark.parametrize("data", [b"\xc1\xc1garbage", b"", msgpack.packb([1, 2])])
def test_garbage_is_a_message_error(data: bytes) -> None:
    with pytest.raises(MessageError):
        decode(PromptTask, data)


def test_reward_status_is_typed() -> None:
    with pytest.raises(ValidationError, match="status"):
        RewardResult(status="zero")  # type: ignore[arg-type]
