"""`stream: true` answers: the recorded completion cut into each API's server-sent events.

The completion is generated (and recorded) exactly as without streaming, then sent as events: one
text delta per output token (with its logprob when asked), tool calls as whole deltas, and the API's
closing events. So streaming changes nothing in what is trained on; it only changes the wire format,
and the first event arrives when the completion is done, not earlier.

- Chat Completions: `data: <chat.completion.chunk>` lines, a last usage chunk when
  `stream_options.include_usage`, then `data: [DONE]`.
- Responses: `event: response.created` ... `response.output_text.delta` ... `response.completed`
  (or `response.incomplete`), with `sequence_number`s.
- Anthropic Messages: `message_start`, `content_block_start/delta/stop` (`text_delta`,
  `input_json_delta`), `message_delta` (stop_reason, stop_sequence, usage), `message_stop`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from services.rollout.agent import replies
from services.rollout.agent.cache import Interaction
from services.rollout.agent.chat import ChatTokenizer
from services.rollout.agent.requests import CanonicalRequest

Event = tuple[str | None, Any]
"""(SSE event name or None, data: a JSON-able object or a literal string)."""


def encode(event: Event) -> bytes:
    name, data = event
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return ((f"event: {name}\n" if name else "") + f"data: {text}\n\n").encode()


# ---------------------------------------------------------------------------------- chat completions


def chat_events(items: list[Interaction], request: CanonicalRequest, chat: ChatTokenizer) -> Iterator[Event]:
    head = {"id": items[0].id, "object": "chat.completion.chunk", "created": int(time.time()), "model": request.model}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> Event:
        return None, {**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

    for index, item in enumerate(items):
        yield chunk(index, {"role": "assistant", "content": ""})
        message = replies.chat_message(item)
        pieces = replies.content_pieces(message["content"] or "", item, chat)
        entries = replies.logprob_entries(item, request, chat) if request.logprobs else None
        for i, piece in enumerate(pieces):
            if piece or entries:
                yield chunk(index, {"content": piece}, logprobs={"content": [entries[i]], "refusal": None} if entries else None)
        for j, call in enumerate(message.get("tool_calls") or ()):
            yield chunk(index, {"tool_calls": [{"index": j, **call}]})
        yield chunk(index, {}, replies.finish_reason(item))
    if request.include_usage:
        prompt, completion = replies.usage(items)
        yield None, {**head, "choices": [],
                     "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
    yield None, "[DONE]"


# ----------------------------------------------------------------------------------------- responses


def responses_events(item: Interaction, request: CanonicalRequest, chat: ChatTokenizer) -> Iterator[Event]:
    seq = iter(range(1 << 30))

    def event(kind: str, **fields: Any) -> Event:
        return kind, {"type": kind, "sequence_number": next(seq), **fields}

    yield event("response.created", response=replies.response(item, request, chat, status="in_progress"))
    yield event("response.in_progress", response=replies.response(item, request, chat, status="in_progress"))
    for index, out in enumerate(replies.response_output(item, request, chat)):
        place = {"item_id": out["id"], "output_index": index}
        if out["type"] == "message":
            yield event("response.output_item.added", output_index=index, item={**out, "status": "in_progress", "content": []})
            part = out["content"][0]
            yield event("response.content_part.added", **place, content_index=0, part={**part, "text": "", "logprobs": []})
            logprobs = part["logprobs"]
            for i, piece in enumerate(replies.content_pieces(part["text"], item, chat)):
                if piece or logprobs:
                    yield event("response.output_text.delta", **place, content_index=0, delta=piece,
                                logprobs=[logprobs[i]] if logprobs else [])
            yield event("response.output_text.done", **place, content_index=0, text=part["text"], logprobs=logprobs)
            yield event("response.content_part.done", **place, content_index=0, part=part)
        else:
            yield event("response.output_item.added", output_index=index, item={**out, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", **place, delta=out["arguments"])
            yield event("response.function_call_arguments.done", **place, arguments=out["arguments"], name=out["name"])
        yield event("response.output_item.done", output_index=index, item=out)
    final = replies.response(item, request, chat)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


# ----------------------------------------------------------------------------------------- anthropic


def anthropic_events(item: Interaction, request: CanonicalRequest, chat: ChatTokenizer) -> Iterator[Event]:
    message = replies.anthropic_message(item, request)
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": message["usage"]["input_tokens"], "output_tokens": 0}}
    yield "message_start", {"type": "message_start", "message": start}
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
            for piece in replies.content_pieces(block["text"], item, chat):
                if piece:
                    yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                                  "delta": {"type": "text_delta", "text": piece}}
        else:
            yield "content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": {**block, "input": {}}}
            yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
                            "usage": {"output_tokens": message["usage"]["output_tokens"]}}
    yield "message_stop", {"type": "message_stop"}
