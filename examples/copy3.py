"""The demo as a single-file customisation: a workflow and a reward function. The config is
`examples/copy3.yaml`; run it with

    jetrl up --config examples/copy3.yaml

The task: the prompt `<bos>123=` asks the model to copy the three digits; the reward is the fraction
of positions right, plus a small credit for stopping (<eos>) right after them ("partial_eos" in
docs/reference/tiny-model-rl.md). The tiny model learns it from chance (~0.02) in ~150 steps.
"""

from __future__ import annotations

import asyncio
from typing import Any

from jetrl import ModelRequest, RolloutWorkflow, concat_padded, encode_chat, reward_items, sample_tensors, score


def reward(completion: str = "", completion_ids: list[int] | None = None, answer: str = "", **_: Any) -> float:
    """Runs in the reward service's process pool (allow-listed in copy3.yaml)."""
    right = sum(1 for a, b in zip(completion, answer, strict=False) if a == b)
    stopped = bool(completion_ids) and len(completion_ids) == len(answer) + 1 and completion_ids[-1] == 2
    return (right + (1 if stopped else 0)) / (len(answer) + 1)


class Copy3Workflow(RolloutWorkflow):
    """Sample a group, score it with the reward service, return the padded tensors (None = reject)."""

    def __init__(self, tokenizer: Any, reward: Any, reward_fn: str, group_size: int = 8, max_new_tokens: int = 4) -> None:
        self.tokenizer, self.reward, self.reward_fn = tokenizer, reward, reward_fn
        self.group_size, self.max_new_tokens = group_size, max_new_tokens

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        prompt_ids = encode_chat(self.tokenizer, data["prompt"])
        request = ModelRequest(input_ids=prompt_ids, max_new_tokens=self.max_new_tokens, stop_token_ids=[self.tokenizer.eos_token_id])
        outs = await asyncio.gather(*(engine.agenerate(request) for _ in range(self.group_size)))
        texts = [(self.tokenizer.decode(o.output_ids, skip_special_tokens=True), o.output_ids) for o in outs]
        rewards = await score(self.reward, self.reward_fn, reward_items(data, data["prompt"], prompt_ids, texts), None)
        samples = [
            sample_tensors(prompt_ids, o.output_ids, o.output_logprobs, o.output_versions, r)
            for o, r in zip(outs, rewards, strict=True)
            if r is not None
        ]
        return concat_padded(samples) if samples else None
