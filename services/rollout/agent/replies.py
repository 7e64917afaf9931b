"""A recorded interaction answered in each dialect: a ChatCompletion, a Responses `response`, an
Anthropic `message`. Pure functions of the interaction; the SDKs parse these as their own types."""

from __future__ import annotations

import json
import time
from typing import Any

from services.rollout.agent.cache import Interaction


def _usage(item: Interaction) -> tuple[int, int]:
    return len(item.prompt_ids), len(item.output_ids)


def _calls(item: Interaction) -> list[dict[str, Any]]:
    return list(item.reply.get("tool_calls") or [])


def chat_completion(item: Interaction, model: str) -> dict[str, Any]:
    calls = _calls(item)
    finish = "tool_calls" if calls else ("length" if item.stop_reason == "length" else "stop")
    message: dict[str, Any] = {"role": "assistant", "content": item.reply["content"] if (item.reply["content"] or not calls) else None,
                               "refusal": None}
    if calls:
        message["tool_calls"] = calls
    prompt, completion = _usage(item)
    return {
        "id": item.id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


def response(item: Interaction, model: str) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if item.reply["content"] or not _calls(item):
        output.append({
            "type": "message", "id": f"msg_{item.id}", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": item.reply["content"], "annotations": []}],
        })
    for call in _calls(item):
        output.append({
            "type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"], "status": "completed",
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
        })
    prompt, completion = _usage(item)
    truncated = item.stop_reason == "length"
    return {
        "id": item.id,
        "object": "response",
        "created_at": time.time(),
        "model": model,
        "status": "incomplete" if truncated else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "error": None,
        "instructions": None,
        "metadata": {},
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "temperature": None,
        "top_p": None,
        "usage": {
            "input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def anthropic_message(item: Interaction, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if item.reply["content"] or not _calls(item):
        content.append({"type": "text", "text": item.reply["content"]})
    for call in _calls(item):
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    prompt, completion = _usage(item)
    stop = "tool_use" if _calls(item) else ("max_tokens" if item.stop_reason == "length" else "end_turn")
    return {
        "id": item.id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": completion},
    }
