"""Interactions (one recorded completion each) and the per-session cache that links them into a
conversation tree and turns rewards into discounted returns.

Parent rule: a completion's parent is the cached interaction whose messages plus its reply are the
longest prefix of the new request's messages (the latest one on a tie). An identical request asked
twice is therefore a sibling, not a child: that is a branch.

Rewards: `set_reward` gives an interaction its own reward. `returns(discount)` walks leaves first
(reverse creation order: a child is always created after its parent) and gives each interaction
`own reward (0 if unset) + discount * mean(children's returns)`. For A -> B -> C with only C = 1.0 and
discount 0.9 that is B = 0.9 and A = 0.81; on a branch the children's returns are averaged, so
exploring two continuations does not double the credit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.rollout.agent.requests import Message, message_key

DISCOUNT_RULES = ("tree", "creation_order")
"""How rewards propagate back to earlier turns (`InteractionCache.returns`)."""


@dataclass(eq=False)
class Interaction:
    id: str
    api: str
    """"chat", "responses" or "messages"."""
    messages: list[Message]
    """The request's canonical messages."""
    reply: Message
    """The canonical assistant message answered (content + tool calls)."""
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: str
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per output token its most likely (token id, logprob), when the request asked for top_logprobs."""
    stop_sequence: str | None = None
    """The stop string the completion was cut at (stop_reason "stop"), if any."""
    incremental: bool = False
    """True when `prompt_ids` extends the parent's exact tokens (the only case `concat` accepts)."""
    parent: Interaction | None = None
    children: list[Interaction] = field(default_factory=list)
    reward: float | None = None
    seq: int = 0

    @property
    def model_response(self) -> Any:
        """The generation as AReaL's `InteractionWithTokenLogpReward.model_response` has it."""
        from services.rollout.io_struct import ModelResponse

        return ModelResponse(input_ids=list(self.prompt_ids), output_ids=list(self.output_ids),
                             output_logprobs=list(self.output_logprobs), output_versions=list(self.output_versions),
                             stop_reason=self.stop_reason, latency_s=0.0, server="")

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def conversation(self) -> list[Message]:
        """The messages a continuation repeats: the request's plus the reply."""
        return [*self.messages, self.reply]


class InteractionCache:
    """The interactions of one session, in creation order."""

    def __init__(self) -> None:
        self._items: dict[str, Interaction] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, interaction_id: object) -> bool:
        return interaction_id in self._items

    def get(self, interaction_id: str) -> Interaction | None:
        return self._items.get(interaction_id)

    def values(self) -> list[Interaction]:
        return list(self._items.values())

    def find_parent(self, messages: list[Message]) -> Interaction | None:
        keys = [message_key(m) for m in messages]
        best: Interaction | None = None
        best_len = 0
        for item in self._items.values():
            conv = item.conversation
            n = len(conv)
            if n > len(keys) or n < best_len:
                continue
            # strict=False: the new messages only have to start with conv (n <= len(keys) above)
            if all(message_key(m) == k for m, k in zip(conv, keys, strict=False)):
                best, best_len = item, n  # later items win ties: the most recent branch
        return best

    def add(self, interaction: Interaction) -> Interaction:
        if interaction.id in self._items:
            raise ValueError(f"interaction {interaction.id} is already cached")
        self._seq += 1
        interaction.seq = self._seq
        if interaction.parent is not None:
            interaction.parent.children.append(interaction)
        self._items[interaction.id] = interaction
        return interaction

    @property
    def last(self) -> Interaction | None:
        return next(reversed(self._items.values()), None) if self._items else None

    def set_reward(self, reward: float, interaction_id: str | None = None) -> Interaction:
        """Reward `interaction_id`, or the latest completion. KeyError/LookupError name what is missing."""
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
            raise ValueError(f"reward must be a finite number, got {reward!r}")
        if interaction_id is None:
            target = self.last
            if target is None:
                raise LookupError("no completion in this session yet to reward")
        else:
            target = self._items.get(interaction_id)
            if target is None:
                raise KeyError(f"no completion {interaction_id!r} in this session")
        target.reward = float(reward)
        return target

    def has_rewards(self) -> bool:
        return any(i.reward is not None for i in self._items.values())

    def returns(self, discount: float, rule: str = "tree") -> dict[str, float]:
        """Each interaction's discounted return. `rule` "tree" (jetrl's): own reward plus `discount`
        times the mean of its children's returns; "creation_order" (AReaL's): walking back from the
        latest interaction, `return[i] = reward[i] + discount * return[i+1]` in creation order,
        whatever the conversation tree."""
        if not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {discount}")
        if rule not in DISCOUNT_RULES:
            raise ValueError(f"discount rule must be one of {DISCOUNT_RULES}, got {rule!r}")
        if rule == "creation_order":
            running, linear = 0.0, {}
            for item in sorted(self._items.values(), key=lambda i: i.seq, reverse=True):
                running = running * discount + (item.reward or 0.0)
                linear[item.id] = running
            return linear
        out: dict[str, float] = {}
        for item in sorted(self._items.values(), key=lambda i: i.seq, reverse=True):
            value = item.reward or 0.0
            if item.children:
                value += discount * sum(out[c.id] for c in item.children) / len(item.children)
            out[item.id] = value
        return out

    def roots(self) -> list[Interaction]:
        return [i for i in self._items.values() if i.parent is None]

    def leaves(self) -> list[Interaction]:
        return [i for i in self._items.values() if not i.children]

    def summary(self) -> dict[str, Any]:
        return {"interactions": len(self._items), "leaves": len(self.leaves()), "roots": len(self.roots())}
