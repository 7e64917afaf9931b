"""OpenAI's legacy `/v1/completions` (text in, text out, no chat template), for agent frameworks and
evaluation harnesses that still call it.

The prompt is tokenized as it is (the tokenizer's own special tokens, e.g. BOS, added as `tokenizer(prompt)`
adds them), generated and recorded like a chat completion (exact ids, logprobs and versions; exported
the same way), with `stop`, `seed`, `n`, `max_tokens`, `temperature`, `top_p`; the text is not
parsed for tool calls. `logprobs` (an integer: the top log-probs per token), `echo`, `suffix`
and `best_of` > n are refused with a 400 naming them; a list of prompts is refused too (send one
request per prompt). `stream: true` answers the completion as server-sent `text_completion` chunks
(one per choice) and `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from services.rollout.agent import fields
from services.rollout.agent.cache import Interaction
from services.rollout.agent.errors import bad_request
from services.rollout.agent.options import ToolChoice
from services.rollout.agent.requests import SERVED_MODEL, CanonicalRequest, samples

FINISH = {"stop": "stop", "length": "length"}


def parse_completions(body: Any) -> CanonicalRequest:
    body = fields.body_object(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string (one prompt per request; token-id prompts are not supported)", "prompt")
    for name in ("echo", "suffix"):
        if body.get(name):
            raise bad_request(f"{name} is not supported by the proxy", name)
    if body.get("logprobs") is not None:
        raise bad_request("logprobs is not supported on /v1/completions; use /v1/chat/completions with logprobs", "logprobs")
    n = samples(body)
    if body.get("best_of") not in (None, n):
        raise bad_request("best_of other than n is not supported", "best_of")
    return CanonicalRequest(
        messages=[{"role": "user", "content": prompt}],
        raw_prompt=prompt,
        tool_choice=ToolChoice("none"),  # the text is the answer: no tool-call parsing
        stream=fields.flag(body, "stream"),
        n=n,
        max_new_tokens=fields.number(body, "max_tokens", int, 1) or 16,  # OpenAI's default for this endpoint
        model=SERVED_MODEL,
        **fields.sampling(body),
    )


def _choice(i: int, item: Interaction) -> dict[str, Any]:
    return {"index": i, "text": item.reply["content"], "logprobs": None, "finish_reason": FINISH.get(item.stop_reason, "stop")}


def completion(items: list[Interaction]) -> dict[str, Any]:
    """The `text_completion` answer for the recorded completions of one request."""
    prompt = len(items[0].prompt_ids)
    out = sum(len(i.output_ids) for i in items)
    return {"id": items[0].id, "object": "text_completion", "created": int(time.time()), "model": SERVED_MODEL,
            "choices": [_choice(i, item) for i, item in enumerate(items)],
            "usage": {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}}


def completion_events(items: list[Interaction]) -> list[bytes]:
    """The same as server-sent events: one chunk per choice, then `[DONE]`."""
    whole = completion(items)
    chunks = [{**{k: v for k, v in whole.items() if k != "usage"}, "choices": [choice]} for choice in whole["choices"]]
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
