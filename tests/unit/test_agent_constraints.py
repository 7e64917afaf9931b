"""tool_choice / response_format as the constraint sent to the server (constraints.py), and the parser
reading back what a constrained completion looks like: a final `<tool_call>` block ended by EOS, and a
string holding a raw tab (xgrammar 0.2.7 allows one under `maxLength`)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.rollout.agent.constraints import JSON_OBJECT, output_constraint
from services.rollout.agent.errors import ProxyError
from services.rollout.agent.options import ResponseFormat, ToolChoice, unmet
from services.rollout.agent.toolcalls import parse_tool_calls

ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now", "parameters": {}}}]


def test_each_option_becomes_the_schema_of_what_the_parser_reads() -> None:
    assert output_constraint(TOOLS, ToolChoice(), ResponseFormat()) is None
    assert output_constraint(TOOLS, ToolChoice("none"), ResponseFormat()) is None
    assert output_constraint(None, ToolChoice(), ResponseFormat("json_object")) == JSON_OBJECT == '{"type": "object"}'
    assert json.loads(output_constraint(None, ToolChoice(), ResponseFormat("json_schema", ADD)) or "") == ADD
    required = json.loads(output_constraint(TOOLS, ToolChoice("required"), ResponseFormat()) or "")
    named = json.loads(output_constraint(TOOLS, ToolChoice("named", "add"), ResponseFormat()) or "")
    call = {"name": "add", "arguments": {"a": 1}}
    jsonschema.validate(call, required)
    jsonschema.validate(call, named)
    jsonschema.validate({"name": "now", "arguments": {}}, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "now", "arguments": {}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {"a": 1}, "extra": 1}, required)
    with pytest.raises(ProxyError, match="cannot be combined with response_format"):
        output_constraint(TOOLS, ToolChoice("required"), ResponseFormat("json_object"))


def test_a_call_ended_by_eos_and_a_raw_tab_in_a_string_are_read() -> None:
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "note": "x\ty"}}'  # no </tool_call>: the grammar ended it
    content, [call] = parse_tool_calls(text)
    assert content == "" and call.name == "add" and json.loads(call.arguments) == {"a": 1, "note": "x\ty"}
    assert "\\t" in call.arguments  # re-encoded: strict JSON for the client
    assert unmet(content, [call], TOOLS, ToolChoice("required"), ResponseFormat()) is None
    assert unmet('{"s": "a\tb"}', [], None, ToolChoice(), ResponseFormat("json_object")) is None
    kept, none = parse_tool_calls("<tool_call>not json")
    assert kept == "<tool_call>not json" and not none
