"""A reward function with AReaL's signature for the copy3 task (`<bos>123=` -> `123`)."""

from __future__ import annotations

from typing import Any


def copy3_reward_fn(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    answer = str(data["answer"])
    return sum(1 for a, b in zip(completions, answer, strict=False) if a == b) / len(answer)
