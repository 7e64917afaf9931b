"""Recorded interactions answered in each dialect: a ChatCompletion (one choice per sample of `n`), a
Responses `response`, an Anthropic `message`. Pure functions of the interactions and the request;
the SDKs parse these as their own types, and `streaming` cuts the same answers into events.

Logprobs are one entry per recorded output token (an end-of-turn or stop token included, so the list
is exactly the tokens trained on). Each entry's `top_logprobs` holds the `top_logprobs` most likely
tokens the inference server reported for that position (from the distribution the token was drawn
from, most likely first), each decoded with the proxy's tokenizer.
"""

from __future__ import annotations

import json
import time
from typing import Any

from services.rollout.agent.cache import Interaction
from services.rollout.agent.chat import ChatTokenizer
from services.rollout.agent.requests import CanonicalRequest


def _calls(item: Interaction) -> list[dict[str, Any]]:
    return list(item.reply.get("tool_calls") or [])


def usage(items: list[Interaction]) -> tuple[int, int]:
    """(prompt tokens, completion tokens of all samples)."""
    return len(items[0].prompt_ids), sum(len(i.output_ids) for i in items)


def _token(chat: ChatTokenizer, tok: int, logprob: float) -> dict[str, Any]:
    text = chat.decode([tok], skip_special_tokens=False)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def logprob_entries(item: Interaction, request: CanonicalRequest, chat: ChatTokenizer) -> list[dict[str, Any]]:
    entries = []
    tops = item.output_top_logprobs if request.top_logprobs else []
    for i, (tok, logprob) in enumerate(zip(item.output_ids, item.output_logprobs, strict=True)):
        top = [_token(chat, t, lp) for t, lp in tops[i][: request.top_logprobs]] if i < len(tops) else []
        entries.append({**_token(chat, tok, logprob), "top_logprobs": top})
    return entries


def content_pieces(content: str, item: Interaction, chat: ChatTokenizer) -> list[str]:
    """`content` split along the output tokens (one piece each, "" for a token with no text of its own);
    what per-token decoding cannot place (a multi-byte character split across tokens, tool-call markup)
    goes with the last token, so the pieces always join to `content`."""
    pieces, pos = [], 0
    for tok in item.output_ids:
        piece = chat.decode([tok])
        if piece and content.startswith(piece, pos):
            pieces.append(piece)
            pos += len(piece)
        else:
            pieces.append("")
    if pos < len(content):
        if not pieces:
            pieces.append("")
        pieces[-1] += content[pos:]
    return pieces


def finish_reason(item: Interaction) -> str:
    return "tool_calls" if _calls(item) else ("length" if item.stop_reason == "length" else "stop")


def chat_message(item: Interaction) -> dict[str, Any]:
    calls = _calls(item)
    message: dict[str, Any] = {"role": "assistant", "content": item.reply["content"] if (item.reply["content"] or not calls) else None,
                               "refusal": None}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_completion(items: list[Interaction], request: CanonicalRequest, chat: ChatTokenizer) -> dict[str, Any]:
    choices = []
    for index, item in enumerate(items):
        logprobs = {"content": logprob_entries(item, request, chat), "refusal": None} if request.logprobs else None
        choices.append({"index": index, "message": chat_message(item), "finish_reason": finish_reason(item), "logprobs": logprobs})
    prompt, completion = usage(items)
    return {
        "id": items[0].id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


def response_output(item: Interaction, request: CanonicalRequest, chat: ChatTokenizer) -> list[dict[str, Any]]:
    output: list[dict[str, Any]] = []
    if item.reply["content"] or not _calls(item):
        logprobs = logprob_entries(item, request, chat) if request.logprobs else []
        output.append({
            "type": "message", "id": f"msg_{item.id}", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": item.reply["content"], "annotations": [], "logprobs": logprobs}],
        })
    for call in _calls(item):
        output.append({
            "type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"], "status": "completed",
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
        })
    return output


def _tool_choice(request: CanonicalRequest) -> Any:
    choice = request.tool_choice
    return {"type": "function", "name": choice.name} if choice.mode == "named" else choice.mode


def response(item: Interaction, request: CanonicalRequest, chat: ChatTokenizer, status: str | None = None) -> dict[str, Any]:
    """The Responses API object; `status` overrides the final one (streaming's first snapshot)."""
    prompt, completion = usage([item])
    truncated = item.stop_reason == "length"
    done = status is None
    return {
        "id": item.id,
        "object": "response",
        "created_at": time.time(),
        "model": request.model,
        "status": status or ("incomplete" if truncated else "completed"),
        "incomplete_details": {"reason": "max_output_tokens"} if truncated and done else None,
        "error": None,
        "instructions": None,
        "metadata": {},
        "output": response_output(item, request, chat) if done else [],
        "parallel_tool_calls": True,
        "tool_choice": _tool_choice(request),
        "tools": [],
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_logprobs": request.top_logprobs,
        "usage": {
            "input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0},
        } if done else None,
    }


def anthropic_stop(item: Interaction) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) as Anthropic reports them."""
    if _calls(item):
        return "tool_use", None
    if item.stop_sequence is not None:
        return "stop_sequence", item.stop_sequence
    return ("max_tokens" if item.stop_reason == "length" else "end_turn"), None


def anthropic_content(item: Interaction) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = []
    if item.reply["content"] or not _calls(item):
        content.append({"type": "text", "text": item.reply["content"]})
    for call in _calls(item):
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    return content


def anthropic_message(item: Interaction, request: CanonicalRequest) -> dict[str, Any]:
    prompt, completion = usage([item])
    stop_reason, stop_sequence = anthropic_stop(item)
    return {
        "id": item.id,
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": anthropic_content(item),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": prompt, "output_tokens": completion},
    }
