"""RLVR (reinforcement learning with verifiable rewards): chat-template the prompt, sample
`group_size` completions, score them with the reward service, return the group.

A sample whose reward could not be computed (timeout, error) is dropped; a group with none left is
rejected (None). The group is built as numpy arrays (`groups.GroupBuilder`): the same trajectory
message as `concat_padded` of `sample_tensors` would give, without torch.
"""

from __future__ import annotations

import asyncio
from typing import Any

from services.rollout.engine_api import InferenceEngine
from services.rollout.groups import GroupBuilder
from services.rollout.io_struct import BadRequestError, ModelRequest, ModelResponse
from services.rollout.tensors import TensorDict
from services.rollout.workflow import RolloutWorkflow, workflow_context
from services.rollout.workflows.common import (
    ChatPrompts,
    RewardScorer,
    load_tokenizer,
    prompt_text,
    refused,
    reward_items,
    score,
)


class RLVRWorkflow(RolloutWorkflow):
    def __init__(
        self,
        tokenizer: Any,
        reward: RewardScorer,
        reward_fn: str = "services.reward.builtin:copy3",
        group_size: int = 8,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        stop_token_ids: list[int] | None = None,
        reward_timeout_s: float | None = None,
        prompt_key: str = "prompt",
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.tokenizer = load_tokenizer(tokenizer)
        self.prompts = ChatPrompts(self.tokenizer)
        self.reward = reward
        self.reward_fn = reward_fn
        self.group_size = group_size
        self.request = ModelRequest(
            input_ids=[],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=list(stop_token_ids or []),
        )
        self.reward_timeout_s = reward_timeout_s
        self.prompt_key = prompt_key

    async def generate(self, engine: InferenceEngine, prompt_ids: list[int]) -> list[ModelResponse]:
        episode = workflow_context.prompt_id
        base = {**self.request.__dict__, "input_ids": list(prompt_ids)}
        try:
            return list(await asyncio.gather(*(engine.agenerate(ModelRequest(**base), episode=episode) for _ in range(self.group_size))))
        except BadRequestError as exc:
            raise refused(exc) from exc
        finally:
            if episode is not None:
                engine.release_episode(episode)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict | None:
        prompt = prompt_text(data, self.prompt_key)
        prompt_ids = self.prompts.ids(prompt)
        responses = await self.generate(engine, prompt_ids)
        completions = [(self.tokenizer.decode(r.output_ids, skip_special_tokens=True), r.output_ids) for r in responses]
        rewards = await score(self.reward, self.reward_fn, reward_items(data, prompt, prompt_ids, completions), self.reward_timeout_s)
        group = GroupBuilder()
        for r, value in zip(responses, rewards, strict=True):
            if value is not None:
                group.add_sample(prompt_ids, r.output_ids, r.output_logprobs, r.output_versions, value)
        return group.arrays() if len(group) else None
