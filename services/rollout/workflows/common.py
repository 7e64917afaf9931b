"""What the built-in workflows share: the chat-templated prompt, the reward call, error mapping.

Token ids travel end to end: the prompt is tokenized once here, completions come back as ids from
the server, and text is decoded only for the reward function.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from schemas.messages import RewardItem, RewardResult
from services.common.logging import get_logger
from services.rollout.workflow import WorkflowError

log = get_logger("rollout.workflow")

#: keyword names the reward call fills itself; a dataset row's copies are dropped, not passed twice
_RESERVED = {"prompt", "completion", "prompt_ids", "completion_ids"}


class RewardScorer(Protocol):
    """`services.reward.client.RewardClient` (or anything that scores the same way)."""

    async def score(self, fn: str, items: list[RewardItem], timeout_s: float | None = None) -> list[RewardResult]: ...


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object, or a model directory to load it from."""
    if isinstance(tokenizer, str):
        from services.rollout.tokenizer import load_pretrained_tokenizer

        return load_pretrained_tokenizer(tokenizer)
    if tokenizer is None:
        raise WorkflowError("the workflow needs a tokenizer (set model_path)")
    return tokenizer


def encode_chat(tokenizer: Any, content: str) -> list[int]:
    """One user message, chat-templated with the generation prompt, as token ids."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


class ChatPrompts:
    """`encode_chat` with its answers kept: a dataset is seen again every epoch (and a prompt again at
    each retry), and chat-templating plus tokenizing is the largest part of a short episode's own
    CPU. Least recently used prompts go first once the kept ids pass `max_tokens` (stored as int32
    ids: 4 bytes a token). Each call returns a fresh list, so a caller may change it."""

    def __init__(self, tokenizer: Any, max_tokens: int = 1_000_000) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self._kept: OrderedDict[str, array[int]] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.misses = 0

    def ids(self, content: str) -> list[int]:
        kept = self._kept.get(content)
        if kept is not None:
            self._kept.move_to_end(content)
            self.hits += 1
            return kept.tolist()
        self.misses += 1
        ids = encode_chat(self.tokenizer, content)
        if len(ids) > self.max_tokens:
            return ids
        try:
            self._kept[content] = array("i", ids)
        except OverflowError:  # an id past int32 (no real vocabulary has one): not kept, still right
            return ids
        self._tokens += len(ids)
        while self._tokens > self.max_tokens:
            _, dropped = self._kept.popitem(last=False)
            self._tokens -= len(dropped)
        return ids


def prompt_text(data: dict[str, Any], key: str) -> str:
    if key not in data:
        raise WorkflowError(f"dataset row has no {key!r} field (keys: {sorted(data)})")
    return str(data[key])


def reward_items(
    data: dict[str, Any], prompt: str, prompt_ids: Sequence[int], completions: Sequence[tuple[str, Sequence[int]]]
) -> list[RewardItem]:
    row = {k: v for k, v in data.items() if k not in _RESERVED}
    return [
        RewardItem(prompt=prompt, completion=text, prompt_ids=list(prompt_ids), completion_ids=list(ids), data=row)
        for text, ids in completions
    ]


async def score(reward: RewardScorer, fn: str, items: list[RewardItem], timeout_s: float | None) -> list[float | None]:
    """Rewards, None for an item the service could not score (timeout / error: never a silent 0).
    A refused request (function not allowed) is a WorkflowError: retrying cannot fix it. No reward
    service answering propagates as is: the worker retries the prompt later."""
    from services.reward.client import RewardRequestError

    try:
        results = await reward.score(fn, items, timeout_s)
    except RewardRequestError as exc:
        raise WorkflowError(f"reward service refused {fn}: {exc}") from exc
    values: list[float | None] = []
    for result in results:
        if result.status == "ok" and result.value is not None:
            values.append(float(result.value))
        else:
            log.warning("reward not computed; sample dropped", fn=fn, status=result.status, message=result.message)
            values.append(None)
    return values



def refused(exc: Exception) -> WorkflowError:
    """A 400 from the inference server is this request's fault (too long, bad parameters): no retry."""
    return WorkflowError(f"inference server refused the request: {exc}")
