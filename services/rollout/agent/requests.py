"""The three request dialects (OpenAI Chat Completions, OpenAI Responses, Anthropic Messages) turned
into one canonical form: chat-template messages plus sampling parameters.

A canonical message is `{"role", "content": str}` plus, for an assistant that called tools,
`"tool_calls": [{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}]`, and,
for a tool result, `"tool_call_id"`. It is both what the chat template renders and what parent
resolution compares (`message_key`), so the three dialects share one interaction tree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.rollout.agent import fields
from services.rollout.agent.errors import bad_request
from services.rollout.agent.options import ResponseFormat, ToolChoice, parse_response_format, parse_tool_choice

Message = dict[str, Any]
ROLES = {"system", "developer", "user", "assistant", "tool"}
SERVED_MODEL = "jetrl"
"""The model name every answer carries (and `/v1/models` lists), whatever name the client sent: the
policy being trained, not the model a framework thinks it is calling."""


@dataclass
class CanonicalRequest:
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    """Tool schemas in OpenAI function format (passed to the chat template)."""
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    model: str = SERVED_MODEL
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> bias (Chat Completions and Completions `logit_bias`), passed to the server."""
    store: bool = True
    """Responses API `store`: the response can be retrieved by id later (in its session)."""
    raw_prompt: str | None = None
    """`/v1/completions`: the prompt text, tokenized as it is (no chat template)."""
    previous_id: str | None = None
    """Responses API `previous_response_id`: the conversation continues that response."""
    stream: bool = False
    include_usage: bool = False
    """Chat `stream_options.include_usage`: a last chunk with the usage."""
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    response_format: ResponseFormat = field(default_factory=ResponseFormat)


# ------------------------------------------------------------------------------------------- messages


def message_key(message: Message) -> tuple[Any, ...]:
    """What makes two messages the same turn: role, text, and the tool calls' names and arguments
    (ids are left out: frameworks re-number them)."""
    calls = tuple(
        (c["function"]["name"], _canonical_json(c["function"]["arguments"])) for c in message.get("tool_calls") or ()
    )
    return (message["role"], message["content"], calls)


def _canonical_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True)
    except ValueError:
        return text


# ------------------------------------------------------------------------------------ chat completions


def _chat_message(raw: Any, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object, got {fields.short(raw)}", where)
    role = raw.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", f"{where}.role")
    msg: Message = {"role": role, "content": fields.text(raw.get("content"), f"{where}.content")}
    calls = raw.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        msg["tool_calls"] = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(f"{where}.tool_calls[{j}] needs function.name", f"{where}.tool_calls")
            msg["tool_calls"].append(
                {"id": str(call.get("id") or f"call_{j}"), "type": "function",
                 "function": {"name": fn["name"], "arguments": fields.args_text(fn.get("arguments", "{}"))}}
            )
    if role == "tool" and raw.get("tool_call_id") is not None:
        msg["tool_call_id"] = str(raw["tool_call_id"])
    return msg


def parse_chat(body: Any) -> CanonicalRequest:
    body = fields.body_object(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    max_tokens = fields.number(body, "max_completion_tokens", int, 1) or fields.number(body, "max_tokens", int, 1)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    tools = _tools(body.get("tools"))
    logprobs = fields.flag(body, "logprobs")
    return CanonicalRequest(
        messages=[_chat_message(m, i) for i, m in enumerate(raw)],
        tools=tools,
        stream=fields.flag(body, "stream"),
        include_usage=bool((options or {}).get("include_usage")),
        n=samples(body),
        logprobs=logprobs,
        top_logprobs=fields.top_logprobs(body, logprobs),
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools, "chat"),
        response_format=parse_response_format(body.get("response_format"), "response_format"),
        max_new_tokens=max_tokens,
        model=SERVED_MODEL,
        **fields.sampling(body),
    )


MAX_N = 128
"""The most samples one request may ask for (OpenAI's own limit)."""


def samples(body: dict[str, Any]) -> int:
    n = fields.number(body, "n", int, 1) or 1
    if n > MAX_N:
        raise bad_request(f"n must be <= {MAX_N}, got {n}", "n")
    return int(n)


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    """OpenAI chat tools as they are; Responses (`{"type": "function", "name", ...}`) and Anthropic
    (`{"name", "input_schema"}`) tools converted to it."""
    if not raw:
        return None
    if not isinstance(raw, list):
        raise bad_request("tools must be a list", "tools")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{i}] must be an object", "tools")
        if isinstance(tool.get("function"), dict):
            tools.append({"type": "function", "function": tool["function"]})
        elif isinstance(tool.get("name"), str):
            params = tool.get("parameters", tool.get("input_schema", {"type": "object", "properties": {}}))
            tools.append(
                {
                    "type": "function",
                    "function": {
                        "name": tool["name"],
                        "description": tool.get("description", ""),
                        "parameters": params,
                    },
                }
            )
        else:
            raise bad_request(f"tools[{i}] has no function name", "tools")
    return tools


# ------------------------------------------------------------------------------------------ responses


def parse_responses(body: Any) -> CanonicalRequest:
    body = fields.body_object(body)
    messages: list[Message] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": fields.text(body["instructions"], "instructions")})
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw:
        for i, item in enumerate(raw):
            messages.extend(_response_item(item, i, messages))
    else:
        raise bad_request("input must be a string or a non-empty list of input items", "input")
    prev = body.get("previous_response_id")
    tools = _tools(body.get("tools"))
    include = body.get("include") or []
    if not isinstance(include, list):
        raise bad_request("include must be a list", "include")
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise bad_request("text must be an object", "text")
    logprobs = "message.output_text.logprobs" in include or bool(body.get("top_logprobs"))
    return CanonicalRequest(
        messages=messages,
        tools=tools,
        stream=fields.flag(body, "stream"),
        logprobs=logprobs,
        top_logprobs=fields.top_logprobs(body, logprobs),
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools, "responses"),
        response_format=parse_response_format((text or {}).get("format"), "text.format"),
        max_new_tokens=fields.number(body, "max_output_tokens", int, 1),
        temperature=fields.number(body, "temperature", float, 0),
        top_p=fields.number(body, "top_p", float, 0),
        # not in the Responses API; accepted (e.g. through the SDK's extra_body) as in Chat Completions
        stop=fields.stop(body.get("stop"), "stop"),
        seed=fields.number(body, "seed", int),
        model=SERVED_MODEL,
        previous_id=str(prev) if prev else None,
        store=body.get("store") is None or fields.flag(body, "store"),
    )


def _response_item(item: Any, i: int, so_far: list[Message]) -> list[Message]:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        return [_chat_message({"role": item.get("role"), "content": item.get("content")}, i)]
    if kind == "function_call":
        call = {"id": str(item.get("call_id") or item.get("id") or f"call_{i}"), "type": "function",
                "function": {"name": str(item.get("name")), "arguments": fields.args_text(item.get("arguments", "{}"))}}
        last = so_far[-1] if so_far else None
        if last is not None and last["role"] == "assistant":  # several calls of one turn: one message
            last.setdefault("tool_calls", []).append(call)
            return []
        return [{"role": "assistant", "content": "", "tool_calls": [call]}]
    if kind == "function_call_output":
        return [{"role": "tool", "content": fields.text(item.get("output"), f"{where}.output"), "tool_call_id": str(item.get("call_id"))}]
    raise bad_request(f"{where}: input items of type {kind!r} are not supported", where)


# ----------------------------------------------------------------------------------------- anthropic


def parse_anthropic(body: Any) -> CanonicalRequest:
    body = fields.body_object(body)
    messages: list[Message] = []
    if body.get("system"):
        messages.append({"role": "system", "content": fields.text(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    for i, msg in enumerate(raw):
        messages.extend(_anthropic_message(msg, i))
    tools = _tools(body.get("tools"))
    return CanonicalRequest(
        messages=messages,
        tools=tools,
        stream=fields.flag(body, "stream"),
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools, "messages"),
        max_new_tokens=fields.number(body, "max_tokens", int, 1),
        temperature=fields.number(body, "temperature", float, 0),
        top_p=fields.number(body, "top_p", float, 0),
        top_k=fields.number(body, "top_k", int, 1),
        stop=fields.stop(body.get("stop_sequences"), "stop_sequences"),
        seed=fields.number(body, "seed", int),  # not in the Messages API: an extension (e.g. through extra_body)
        model=SERVED_MODEL,
    )


def _anthropic_message(raw: Any, i: int) -> list[Message]:
    where = f"messages[{i}]"
    if not isinstance(raw, dict) or raw.get("role") not in ("user", "assistant"):
        raise bad_request(f"{where} must be an object with role 'user' or 'assistant'", where)
    role, content = raw["role"], raw.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of blocks", f"{where}.content")
    out: list[Message] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": str(block.get("id")), "type": "function",
                          "function": {"name": str(block.get("name")), "arguments": fields.args_text(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "content": fields.text(block.get("content"), f"{where}.content[{j}].content"),
                        "tool_call_id": str(block.get("tool_use_id"))})
        else:
            raise bad_request(f"{where}.content[{j}]: blocks of type {kind!r} are not supported here", f"{where}.content")
    if text or calls or not out:
        msg: Message = {"role": role, "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out
