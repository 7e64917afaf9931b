"""Multi-turn: answer, get feedback, try again - until the answer is right or the turns run out.

Each sample is one conversation: prompt, completion, feedback, completion, ... The loss sees only the
completions (feedback tokens are loss_mask 0, version -1). The sample's reward is the last turn's
reward times `turn_discount` per extra turn taken, so a right first answer is worth most.
"""

from __future__ import annotations

import asyncio
from typing import Any

from services.rollout.engine_api import InferenceEngine
from services.rollout.groups import GroupBuilder
from services.rollout.io_struct import BadRequestError, ModelRequest
from services.rollout.tensors import Segment, TensorDict
from services.rollout.workflow import RolloutWorkflow, workflow_context
from services.rollout.workflows.common import (
    ChatPrompts,
    RewardScorer,
    encode_chat,
    load_tokenizer,
    prompt_text,
    refused,
    reward_items,
    score,
)

DEFAULT_FEEDBACK = "wrong answer try again:"


class MultiTurnWorkflow(RolloutWorkflow):
    def __init__(
        self,
        tokenizer: Any,
        reward: RewardScorer,
        reward_fn: str = "services.reward.builtin:copy3",
        group_size: int = 8,
        max_turns: int = 3,
        turn_discount: float = 0.9,
        success_reward: float = 1.0,
        feedback: str = DEFAULT_FEEDBACK,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        reward_timeout_s: float | None = None,
        prompt_key: str = "prompt",
    ) -> None:
        """`success_reward`: a turn whose reward reaches it ends the conversation; `feedback`: the
        user message (chat-templated) sent after a wrong answer."""
        if max_turns < 1 or group_size < 1:
            raise ValueError(f"max_turns and group_size must be >= 1, got {max_turns} and {group_size}")
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")
        self.tokenizer = load_tokenizer(tokenizer)
        self.prompts = ChatPrompts(self.tokenizer)
        self.reward = reward
        self.reward_fn = reward_fn
        self.group_size = group_size
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.success_reward = success_reward
        self.feedback_ids = encode_chat(self.tokenizer, feedback)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.reward_timeout_s = reward_timeout_s
        self.prompt_key = prompt_key

    async def conversation(self, engine: InferenceEngine, data: dict[str, Any], episode: str, prompt: str,
                           prompt_ids: list[int]) -> tuple[list[Segment], float] | None:
        """One sample's segments and reward; None when a turn could not be scored."""
        segments: list[Segment] = [(prompt_ids, False, None, None)]
        seq = list(prompt_ids)
        reward = 0.0
        discount = 1.0
        for turn in range(self.max_turns):
            if turn:
                segments.append((self.feedback_ids, False, None, None))
                seq += self.feedback_ids
                discount *= self.turn_discount
            req = ModelRequest(input_ids=list(seq), max_new_tokens=self.max_new_tokens, temperature=self.temperature)
            try:
                resp = await engine.agenerate(req, episode=episode)
            except BadRequestError as exc:
                raise refused(exc) from exc
            segments.append((resp.output_ids, True, resp.output_logprobs, resp.output_versions))
            seq += resp.output_ids
            completion = self.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
            [value] = await score(
                self.reward, self.reward_fn, reward_items(data, prompt, prompt_ids, [(completion, resp.output_ids)]), self.reward_timeout_s
            )
            if value is None:
                return None  # unscored: drop the sample rather than train on a made-up reward
            reward = value
            if reward >= self.success_reward:
                break
        return segments, reward * discount

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict | None:
        """The group as numpy arrays (`groups.GroupBuilder`): the trajectory message `concat_padded` of
        `turn_tensors` would give, without torch. The prompt is chat-templated once for the group."""
        prompt = prompt_text(data, self.prompt_key)
        prompt_ids = self.prompts.ids(prompt)
        task_id = workflow_context.prompt_id or "episode"
        episodes = [f"{task_id}/{i}" for i in range(self.group_size)]
        try:
            results = await asyncio.gather(*(self.conversation(engine, data, e, prompt, prompt_ids) for e in episodes))
        finally:
            for e in episodes:
                engine.release_episode(e)
        group = GroupBuilder()
        for result in results:
            if result is not None:
                group.add_turns(result[0], result[1], len(prompt_ids))
        return group.arrays() if len(group) else None
