"""The built-in workflows' numpy group builder against the public torch helpers, and the kept prompt ids
against encoding each time: the same arrays and the same trajectory message bytes."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from schemas.trajectory import encode_group_with_meta
from services.rollout.groups import GroupBuilder
from services.rollout.tensors import Segment, concat_padded, sample_tensors, turn_tensors
from services.rollout.workflows.common import ChatPrompts, encode_chat


def message(group: dict) -> bytes:
    return encode_group_with_meta(group, run="r", prompt_id="p", worker="w", workflow="wf")[0]


def assert_same(built: dict, helpers: dict) -> None:
    assert list(built) == list(helpers)
    for key, value in helpers.items():
        expected = value.numpy()
        assert built[key].dtype == expected.dtype and np.array_equal(built[key], expected), key
    assert message(built) == message(helpers)


def test_samples_give_the_helpers_arrays_and_message_bytes() -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(100) for _ in range(9)]
    builder, samples = GroupBuilder(), []
    for i in range(8):  # ragged completions, one empty, rewards that round to float32
        n = [0, 1, 4, 7, 2, 3, 5, 6][i]
        out = [rng.randrange(100) for _ in range(n)]
        logp = [-rng.random() * 5 for _ in range(n)]
        vers = [rng.randrange(3, 6) for _ in range(n)]
        reward = rng.random()
        builder.add_sample(prompt, out, logp, vers, reward)
        samples.append(sample_tensors(prompt, out, logp, vers, reward))
    assert len(builder) == 8
    assert_same(builder.arrays(), concat_padded(samples))


def test_turns_give_the_helpers_arrays_and_message_bytes() -> None:
    conversations: list[tuple[list[Segment], float, int]] = [
        ([([1, 2, 3], False, None, None), ([4, 5], True, [-0.5, -0.25], [7, 8])], 1.0, 3),
        ([([1, 2], False, None, None), ([9], True, [-1.0], [7]), ([3, 3], False, None, None), ([4], True, [-2.0], [8])], 0.81, 2),
        ([([6], False, None, None), ([7, 7, 7, 7, 7, 7], True, None, [5] * 6)], -0.3, 1),  # no logprobs given: 0
    ]
    builder = GroupBuilder()
    for segments, reward, prompt_len in conversations:
        builder.add_turns(segments, reward, prompt_len)
    assert_same(builder.arrays(), concat_padded([turn_tensors(*c) for c in conversations]))


def test_builder_refuses_what_the_helpers_refuse() -> None:
    with pytest.raises(ValueError, match="same length"):
        GroupBuilder().add_sample([1], [2, 3], [-1.0], [0, 0], reward=0.0)
    with pytest.raises(ValueError, match="no samples"):
        GroupBuilder().arrays()


def test_kept_prompt_ids_are_the_ids_encoding_gives(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts = ChatPrompts(tok, max_tokens=40)
    texts = [f"{i:03d}=" for i in range(6)] + ["a longer prompt than the others, " * 3]
    for _ in range(2):
        for text in texts:
            ids = prompts.ids(text)
            assert ids == encode_chat(tok, text)
            ids.append(-1)  # a caller changing its list changes nothing kept
    assert prompts.ids("000=") == encode_chat(tok, "000=")
    assert prompts.hits > 0 and prompts.misses > len(texts)  # the long prompt is never kept; old ones go
    assert sum(len(v) for v in prompts._kept.values()) <= 40
