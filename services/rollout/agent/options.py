"""The request options that constrain a completion's shape, `tool_choice` and `response_format`, in
each dialect's spelling, and the check that a completion met them.

How each is honoured: the inference server enforces them while decoding (constraints.py turns them
into SGLang's `json_schema`; the tokens sampled under the constraint, with the logprobs of the
constrained distribution, are what is recorded and trained on), and the proxy conditions the prompt:
- `tool_choice` none: the tools are not rendered into the prompt and the completion is not parsed for
  tool calls (its text is the content, whatever it holds).
- `tool_choice` required / a named tool: the assistant turn is opened with `<tool_call>` (prompt
  tokens, not trained on) and the completion is held to one call object of an offered tool (of the
  named one).
- `response_format` json_object: a JSON object; json_schema: JSON valid against the schema.
The completion is still checked: one that misses its constraint (cut by `max_tokens` before the JSON
ended, or from a server that does not enforce it) is recorded (its tokens are the policy's and can be
rewarded and exported like any other), and the request is answered 422 naming the completion id and
what was wrong, so the agent sees the failure instead of a reply that breaks the contract.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.rollout.agent.errors import bad_request
from services.rollout.agent.toolcalls import ToolCall


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"
    """"auto", "none", "required" or "named"."""
    name: str | None = None

    def prefill(self) -> str:
        """Text that opens the assistant's turn (rendered after the generation prompt)."""
        return "<tool_call>" if self.mode in ("required", "named") else ""

    def label(self) -> str:
        return f"tool_choice {self.name!r}" if self.mode == "named" else f"tool_choice {self.mode!r}"


@dataclass(frozen=True)
class ResponseFormat:
    kind: str = "text"
    """"text", "json_object" or "json_schema"."""
    schema: dict[str, Any] | None = None
    name: str = "response"


def _names(tools: list[dict[str, Any]] | None) -> list[str]:
    return [t["function"]["name"] for t in tools or ()]


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None, dialect: str) -> ToolChoice:
    """OpenAI: "auto" | "none" | "required" | {"type": "function", "function": {"name"}} (chat) or
    {"type": "function", "name"} (Responses). Anthropic: {"type": "auto" | "any" | "none" | "tool", "name"}."""
    if value is None:
        return ToolChoice()
    name: Any = None
    if dialect == "messages":
        kind = value.get("type") if isinstance(value, dict) else None
        mode = {"auto": "auto", "any": "required", "none": "none", "tool": "named"}.get(str(kind))
        name = value.get("name") if isinstance(value, dict) else None
    elif isinstance(value, str):
        mode = value if value in ("auto", "none", "required") else None
    elif isinstance(value, dict) and value.get("type") == "function":
        mode = "named"
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else value.get("name")
    else:
        mode = None
    if mode is None:
        raise bad_request(f"tool_choice {json.dumps(value)[:80]} is not one the proxy knows; use auto, none, required or a named "
                          "function", "tool_choice")
    if mode == "named" and not isinstance(name, str):
        raise bad_request("tool_choice names no tool", "tool_choice")
    if mode in ("required", "named") and not tools:
        raise bad_request(f"tool_choice {mode!r} needs tools", "tool_choice")
    if mode == "named" and name not in _names(tools):
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools ({', '.join(_names(tools))})", "tool_choice")
    return ToolChoice(mode, name if mode == "named" else None)


def parse_response_format(value: Any, where: str) -> ResponseFormat:
    """Chat: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}};
    Responses: `text.format` {"type", "name", "schema"} (the schema beside the type)."""
    if value is None:
        return ResponseFormat()
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise bad_request(f"{where}: type must be text, json_object or json_schema, got {json.dumps(value)[:80]}", where)
    spec = value.get("json_schema", value)
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad_request(f"{where}: json_schema needs a schema object", where)
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError as exc:
        raise bad_request(f"{where}: json_schema needs the jsonschema package in the rollout worker's environment", where) from exc
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad_request(f"{where}: the schema is not a valid JSON schema: {exc.message}", where) from exc
    return ResponseFormat("json_schema", schema, str(spec.get("name") or "response"))


def unmet(content: str, calls: list[ToolCall], tools: list[dict[str, Any]] | None, choice: ToolChoice,
          fmt: ResponseFormat) -> str | None:
    """Why the completion misses its tool_choice / response_format, or None when it meets them."""
    if choice.mode in ("required", "named"):
        if not calls:
            return f"{choice.label()} needs a tool call, but the completion holds no valid <tool_call> block"
        offered = _names(tools)
        for call in calls:
            if call.name not in offered or (choice.mode == "named" and call.name != choice.name):
                return f"{choice.label()}: the completion calls {call.name!r}"
    if fmt.kind == "text" or calls:
        return None
    try:
        value = json.loads(content)
    except ValueError as exc:
        return f"response_format {fmt.kind} needs JSON content, but the completion is not JSON ({exc})"
    if not isinstance(value, dict):
        return f"response_format {fmt.kind} needs a JSON object, got {type(value).__name__}"
    if fmt.kind == "json_schema" and fmt.schema is not None:
        import jsonschema

        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(fmt.schema).iter_errors(value))
        if error is not None:
            return f"response_format json_schema {fmt.name!r}: {error.message}"
    return None
