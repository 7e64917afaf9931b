"""A session's interactions exported as training samples, in one of two styles.

- `individual`: one sample per interaction: its prompt (loss 0) then its completion (loss 1), with
  the interaction's discounted return as reward. Prefixes shared by a conversation's turns repeat.
- `concat`: one sample per leaf, holding the whole conversation from its root: every completion on
  the path is trained on (loss 1), the text between them (tool results, user turns) is not, and the
  leaf's return is the reward. Valid only when each conversation is linear and every child's prompt
  extends its parent's exact tokens; anything else is an `ExportError` that says which interaction
  broke the rule.

Token ids, logprobs and versions are the engine's, copied, never re-tokenized.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from services.rollout.agent.cache import Interaction, InteractionCache
from services.rollout.tensors import TensorDict, concat_padded, turn_tensors

Style = Literal["individual", "concat"]
STYLES = ("individual", "concat")

Segment = tuple[list[int], bool, list[float] | None, list[int] | None]


class ExportError(ValueError):
    """The session cannot be exported in the requested style."""


@dataclass
class AgentSample:
    """One exported training sample (what an agent workflow's dict of interactions holds)."""

    interaction_id: str
    segments: list[Segment]
    reward: float
    prompt_len: int

    def to_tensors(self) -> TensorDict:
        return turn_tensors(self.segments, self.reward, self.prompt_len)

    def to_tensor_dict(self) -> TensorDict:
        """AReaL's name for `to_tensors` (`InteractionWithTokenLogpReward.to_tensor_dict`)."""
        return self.to_tensors()

    def as_json(self) -> dict[str, Any]:
        ids: list[int] = []
        loss: list[int] = []
        logp: list[float] = []
        vers: list[int] = []
        for seg_ids, generated, seg_logp, seg_vers in self.segments:
            ids += seg_ids
            loss += [int(generated)] * len(seg_ids)
            logp += list(seg_logp) if generated and seg_logp is not None else [0.0] * len(seg_ids)
            vers += list(seg_vers) if generated and seg_vers is not None else [-1] * len(seg_ids)
        return {"input_ids": ids, "loss_mask": loss, "logprobs": logp, "versions": vers,
                "reward": self.reward, "prompt_len": self.prompt_len}


def _completion(item: Interaction) -> Segment:
    return (list(item.output_ids), True, list(item.output_logprobs), list(item.output_versions))


def _individual(cache: InteractionCache, returns: dict[str, float]) -> dict[str, AgentSample]:
    return {
        i.id: AgentSample(i.id, [(list(i.prompt_ids), False, None, None), _completion(i)], returns[i.id], len(i.prompt_ids))
        for i in cache.values()
    }


def _chain(leaf: Interaction) -> list[Interaction]:
    path = [leaf]
    while path[-1].parent is not None:
        path.append(path[-1].parent)
    return path[::-1]


def _concat(cache: InteractionCache, returns: dict[str, float]) -> dict[str, AgentSample]:
    for item in cache.values():
        if len(item.children) > 1:
            ids = ", ".join(c.id for c in item.children)
            raise ExportError(
                f"style 'concat' needs linear conversations, but completion {item.id} branches into {len(item.children)} "
                f"continuations ({ids}); export with style 'individual'"
            )
    samples: dict[str, AgentSample] = {}
    for leaf in cache.leaves():
        path = _chain(leaf)
        root = path[0]
        segments: list[Segment] = [(list(root.prompt_ids), False, None, None), _completion(root)]
        for parent, child in itertools.pairwise(path):
            prefix = parent.full_ids
            if child.prompt_ids[: len(prefix)] != prefix:
                raise ExportError(
                    f"style 'concat' needs each turn's prompt to extend the previous turn's exact tokens, but the prompt of "
                    f"completion {child.id} does not start with the tokens of {parent.id} (the history was edited or the "
                    "chat template re-rendered it differently); export with style 'individual'"
                )
            segments.append((list(child.prompt_ids[len(prefix):]), False, None, None))
            segments.append(_completion(child))
        samples[leaf.id] = AgentSample(leaf.id, segments, returns[leaf.id], len(root.prompt_ids))
    return samples


def export_session(cache: InteractionCache, discount: float = 1.0, style: str = "individual",
                   rule: str = "tree") -> dict[str, AgentSample]:
    """Completion id -> sample, with discounted returns as rewards (`rule`: `InteractionCache.returns`)."""
    if style not in STYLES:
        raise ExportError(f"unknown export style {style!r}; expected one of {', '.join(STYLES)}")
    returns = cache.returns(discount, rule)
    return _individual(cache, returns) if style == "individual" else _concat(cache, returns)


def interactions_to_tensors(interactions: Mapping[str, Any]) -> TensorDict:
    """The padded tensor dict of exported samples (anything with `to_tensors()`), one row each."""
    rows = []
    for key, item in interactions.items():
        to_tensors = getattr(item, "to_tensors", None)
        if to_tensors is None:
            from services.rollout.workflow import WorkflowError

            raise WorkflowError(
                f"interaction {key!r} is a {type(item).__name__}; an agent workflow's dict of interactions must hold "
                "exported samples (services.rollout.agent.export.AgentSample)"
            )
        rows.append(to_tensors())
    if not rows:
        raise ValueError("interactions_to_tensors: no interactions")
    return concat_padded(rows)
