"""The tool-call text convention the proxy parses from a completion (Hermes style, what Qwen and
many open models are trained to emit):

    some text <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>

Each `<tool_call>...</tool_call>` block holding a JSON object with a string `name` and an object (or
JSON string) `arguments` becomes one tool call; the text outside the blocks is the message content. A
block whose body is not such an object is not a tool call: it stays in the content as written, so
nothing the model produced silently disappears. A last `<tool_call>` left open (the model ended its
turn right after the object, as it does under a `required` / named tool_choice, whose grammar allows
only EOS once the call object is complete) is read the same way when its body is such an object.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text of the arguments object (what OpenAI's `function.arguments` carries)."""

    def openai(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def arguments_object(self) -> object:
        return json.loads(self.arguments)


def _as_call(body: str, call_id: str) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=call_id, name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, id_prefix: str = "call") -> tuple[str, list[ToolCall]]:
    """(content without the parsed blocks, tool calls in order). Call ids are `{id_prefix}_{i}`,
    unique within the completion."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        call = _as_call(match.group(1), f"{id_prefix}_{len(calls)}")
        kept.append(text[pos : match.start()] if call is not None else text[pos : match.end()])
        pos = match.end()
        if call is not None:
            calls.append(call)
    rest = text[pos:]
    start = rest.find(_OPEN)
    last = _as_call(rest[start + len(_OPEN):], f"{id_prefix}_{len(calls)}") if start >= 0 else None
    if last is not None:
        calls.append(last)
        rest = rest[:start]
    kept.append(rest)
    content = "".join(kept)
    return (content.strip() if calls else content), calls


def format_tool_call(name: str, arguments: object) -> str:
    """The text a model emits for one call under this convention (used to render history and in tests)."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "</tool_call>"
