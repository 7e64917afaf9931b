"""AReaL's `InteractionWithTokenLogpReward` (`areal.experimental.openai.types`): one completion or
response with its token ids, log-probs, versions and reward, as AReaL's code builds it
(`InteractionWithTokenLogpReward(messages=..., chat_template_type=...)`, then `model_response` and
`reward` set; or empty, then `_cache` and `interaction_id` set). A workflow may construct it and
return a dict of them from `arun_episode`: the rollout worker turns each into its sample with
`to_tensor_dict()`, as AReaL's trainer does.

The same fields, defaults, properties and `to_tensor_dict()` as AReaL 1.0.4's: prompt tokens get
log-prob 0, loss mask 0 and version -1; with `chat_template_type="concat"` and a `parent`, the
parent's tensors are the prefix (AReaL's concatenated multi-turn samples). jetrl's own direct client
(`ArealOpenAI`) records its completions in its own interaction tree and exports them itself; this
class is for code that builds AReaL's objects by hand."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog

from services.rollout.io_struct import ModelResponse

log = structlog.get_logger("jetrl.rollout.interaction")


@dataclass
class InteractionWithTokenLogpReward:
    model_response: ModelResponse | None = None
    reward: float | None = None
    parent: InteractionWithTokenLogpReward | None = None
    chat_template_type: str = "hf"
    _cache: dict[str, Any] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The request's messages (parents are resolved by them)."""
    output_message_list: list[dict[str, Any]] | None = None
    completion: Any = None
    """The OpenAI SDK's `ChatCompletion`, for a chat completion."""
    response: Any = None
    """The OpenAI SDK's `Response`, for a Responses API call."""
    input_data: Any = ""
    """The Responses API `input` as given."""
    _interaction_id: str | None = None

    @property
    def has_tensor_data(self) -> bool:
        return self.model_response is not None or self._cache is not None

    @property
    def is_completion(self) -> bool:
        return self.completion is not None

    @property
    def is_response(self) -> bool:
        return self.response is not None

    @property
    def api_type(self) -> str:
        """"completion", "response" or "none" (AReaL's `ApiType` values)."""
        return "completion" if self.is_completion else "response" if self.is_response else "none"

    @property
    def current_data(self) -> Any:
        return self.messages if self.is_completion else self.input_data if self.is_response else None

    @property
    def parent_data(self) -> Any:
        return None if self.parent is None else self.parent.current_data

    @property
    def interaction_id(self) -> str | None:
        if self.is_completion:
            return str(self.completion.id)
        if self.is_response:
            return str(self.response.id)
        return self._interaction_id

    @interaction_id.setter
    def interaction_id(self, value: str | None) -> None:
        if self.is_completion or self.is_response:
            raise ValueError("Cannot set ID for completion or responses")
        self._interaction_id = value

    @property
    def created_at(self) -> float | None:
        if self.is_completion:
            return float(self.completion.created)
        if self.is_response:
            return float(self.response.created_at)
        return None

    @property
    def remaining_messages(self) -> list[dict[str, Any]]:
        """The messages this request adds after its parent's conversation."""
        if self.parent is None:
            return self.messages
        if self.parent.output_message_list is None:
            raise ValueError("Parent output message is not set.")
        return self.messages[len(self.parent.messages + self.parent.output_message_list):]

    def to_tensor_dict(self) -> dict[str, Any]:
        """One sample, batch dimension 1: `input_ids`, `loss_mask`, `logprobs`, `versions`,
        `attention_mask`, and `rewards` (0 when no reward was set)."""
        import torch

        if self._cache is not None:
            return self._cache
        resp = self.model_response
        if resp is None:
            raise ValueError("Model response is not set.")
        seq = resp.input_tokens + resp.output_tokens
        prompt_logprobs, prompt_mask, prompt_versions = [0.0] * resp.input_len, [0] * resp.input_len, [-1] * resp.input_len
        if self.chat_template_type == "concat" and self.parent is not None:
            parent = self.parent.to_tensor_dict()
            lp, lm, vs = (parent[k].squeeze(0).tolist() for k in ("logprobs", "loss_mask", "versions"))
            if resp.input_len > len(lp):
                gap = resp.input_len - len(lp)
                prompt_logprobs, prompt_mask, prompt_versions = lp + [0.0] * gap, lm + [0] * gap, vs + [-1] * gap
            else:  # AReaL masks the parent out then, and warns
                log.warning("child input not longer than its parent's sample: parent masked out",
                            child_input=resp.input_len, parent_len=len(lp), api=self.api_type)
        result = {
            "input_ids": torch.tensor(seq).unsqueeze(0),
            "loss_mask": torch.tensor(prompt_mask + [1] * resp.output_len).unsqueeze(0),
            "logprobs": torch.tensor(prompt_logprobs + list(resp.output_logprobs)).unsqueeze(0),
            "versions": torch.tensor(prompt_versions + list(resp.output_versions)).unsqueeze(0),
            "attention_mask": torch.ones(len(seq), dtype=torch.bool).unsqueeze(0),
            "rewards": torch.tensor([float(self.reward if self.reward is not None else 0.0)]),
        }
        self._cache = result
        return result
