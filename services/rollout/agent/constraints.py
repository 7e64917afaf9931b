"""A request's `tool_choice` / `response_format` as the output constraint the inference server enforces
while decoding (SGLang's `sampling_params.json_schema`), in the shape the proxy reads back.

- `response_format` json_object: `{"type": "object"}` (what SGLang's own OpenAI server sends);
  json_schema: the request's schema.
- `tool_choice` required / a named tool: the assistant turn is opened with `<tool_call>` (prompt
  tokens, see options.py) and the completion is held to one call object `{"name": <tool>, "arguments":
  <the tool's parameters schema>}` (required: any offered tool, `anyOf`; named: that one, its name a
  `const`). Once the object is complete the grammar allows only EOS, so the completion is
  `{"name": ..., "arguments": {...}}<eos>`; the tool-call parser reads a final `<tool_call>` block
  that the model ended without `</tool_call>` (toolcalls.py). One call per completion under these
  choices (`parallel_tool_calls` cannot add more; with `auto` the model writes as many as it likes).
- `auto` / `none` / `text`: no constraint.

SGLang refuses `required` or a named tool combined with a `response_format` (both cannot be honoured):
so does the proxy, with a 400.
"""

from __future__ import annotations

import json
from typing import Any

from services.rollout.agent.errors import bad_request
from services.rollout.agent.options import ResponseFormat, ToolChoice

JSON_OBJECT = '{"type": "object"}'
"""SGLang's constraint for `response_format: json_object` (xgrammar: any JSON object)."""


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters")
    if not isinstance(params, dict) or not params:
        params = {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_schema(tools: list[dict[str, Any]], choice: ToolChoice) -> dict[str, Any]:
    """The JSON schema of the one call a `required` / named tool_choice completion holds."""
    chosen = [t for t in tools if choice.mode == "required" or t["function"]["name"] == choice.name]
    if len(chosen) == 1:
        return _call_schema(chosen[0])
    return {"anyOf": [_call_schema(t) for t in chosen]}


def output_constraint(tools: list[dict[str, Any]] | None, choice: ToolChoice, fmt: ResponseFormat) -> str | None:
    """The `json_schema` (JSON text) to send with the completion's generation, or None."""
    forced = choice.mode in ("required", "named")
    if forced and fmt.kind != "text":
        raise bad_request(f"{choice.label()} cannot be combined with response_format {fmt.kind!r}: the tool-call "
                          "constraint and the output constraint cannot both be honoured", "tool_choice")
    if forced:
        return json.dumps(tool_call_schema(tools or [], choice), ensure_ascii=False)
    if fmt.kind == "json_object":
        return JSON_OBJECT
    if fmt.kind == "json_schema" and fmt.schema is not None:
        return json.dumps(fmt.schema, ensure_ascii=False)
    return None
