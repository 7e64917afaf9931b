"""The agent proxy's pure parts: the tool-call convention, request dialects, the interaction tree
(parents, branches, discounted returns), export styles and incremental prompt tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from services.rollout.agent import streaming
from services.rollout.agent.cache import Interaction, InteractionCache
from services.rollout.agent.chat import ChatTokenizer, glue_after
from services.rollout.agent.errors import ProxyError
from services.rollout.agent.export import ExportError, export_session, interactions_to_tensors
from services.rollout.agent.options import ResponseFormat, ToolChoice, parse_response_format, parse_tool_choice, unmet
from services.rollout.agent.replies import content_pieces
from services.rollout.agent.requests import parse_anthropic, parse_chat, parse_responses
from services.rollout.agent.stops import StopCut, cut_at_stop
from services.rollout.agent.toolcalls import format_tool_call, parse_tool_calls

# ------------------------------------------------------------------------------------------ tool calls


def test_hermes_tool_calls_are_parsed_and_removed_from_the_content() -> None:
    text = 'let me check <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n' + format_tool_call("mul", '{"x": 3}')
    content, calls = parse_tool_calls(text, id_prefix="call_z")
    assert content == "let me check"
    assert [(c.id, c.name, c.arguments_object()) for c in calls] == [("call_z_0", "add", {"a": 1, "b": 2}), ("call_z_1", "mul", {"x": 3})]


@pytest.mark.parametrize(
    "text",
    ["<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>["add"]</tool_call>',
     '<tool_call>{"name": "f", "arguments": 3}</tool_call>', "plain answer 42", "<tool_call>unterminated"],
)
def test_text_that_is_not_a_valid_tool_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


def test_string_arguments_are_accepted_as_json_text() -> None:
    _, [call] = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"hi\\"}"}</tool_call>')
    assert call.arguments_object() == {"q": "hi"}


# ------------------------------------------------------------------------------------------ dialects


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "must be a JSON object"),
        ({}, "messages must be a non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text content parts"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream must be true or false"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n must be >= 1"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 129}, "n must be <= 128"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs needs logprobs=true"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs must be <= 20"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"}, "tool_choice \"always\" is not one"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice 'required' needs tools"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format: type must be"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens must be an integer"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature must be >= 0"),
    ],
)
def test_malformed_chat_requests_are_400_with_the_reason(body: Any, message: str) -> None:
    with pytest.raises(ProxyError) as err:
        parse_chat(body)
    assert err.value.status == 400 and message in err.value.message
    assert err.value.openai_body()["error"]["type"] == "invalid_request_error"


def test_the_three_dialects_meet_in_one_canonical_conversation() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "check", "arguments": '{"answer": "1"}'}}
    chat = parse_chat({"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "right"},
    ], "max_completion_tokens": 7, "stop": "x"})
    resp = parse_responses({"instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "function_call", "call_id": "c1", "name": "check", "arguments": '{"answer":"1"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "right"},
    ]})
    anth = parse_anthropic({"system": "be brief", "max_tokens": 7, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "check", "input": {"answer": "1"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "right"}]},
    ]})
    from services.rollout.agent.requests import message_key

    keys = [[message_key(m) for m in r.messages] for r in (chat, resp, anth)]
    assert keys[0] == keys[1] == keys[2] and len(keys[0]) == 4
    assert chat.max_new_tokens == 7 and chat.stop == ["x"] and anth.max_new_tokens == 7


def test_tools_of_every_dialect_become_openai_functions() -> None:
    schema = {"type": "object", "properties": {}}
    anth = parse_anthropic({"messages": [{"role": "user", "content": "q"}], "tools": [{"name": "f", "input_schema": schema}]})
    resp = parse_responses({"input": "q", "tools": [{"type": "function", "name": "f", "parameters": schema}]})
    assert anth.tools == resp.tools and anth.tools[0]["function"]["name"] == "f"


# ------------------------------------------------------------------------------------ the tree


def make(
    cache: InteractionCache,
    messages: list[dict[str, Any]],
    reply: str,
    prompt: list[int],
    out: list[int],
    parent: Interaction | None = None,
) -> Interaction:
    n = len(cache)
    return cache.add(Interaction(
        id=f"i{n}", api="chat", messages=messages, reply={"role": "assistant", "content": reply}, prompt_ids=prompt,
        output_ids=out, output_logprobs=[-0.5 - k for k in range(len(out))], output_versions=[n] * len(out),
        stop_reason="stop", parent=parent,
    ))


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def bot(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def three_turns() -> tuple[InteractionCache, list[Interaction]]:
    cache = InteractionCache()
    a = make(cache, [user("q")], "a1", [1, 5], [6, 7])
    m_b = [user("q"), bot("a1"), user("more")]
    b = make(cache, m_b, "b1", [1, 5, 6, 7, 8], [9], cache.find_parent(m_b))
    m_c = [*m_b, bot("b1"), user("last")]
    c = make(cache, m_c, "c1", [1, 5, 6, 7, 8, 9, 10], [11, 12], cache.find_parent(m_c))
    return cache, [a, b, c]


def test_parent_is_the_longest_cached_conversation_prefix() -> None:
    cache, (a, b, c) = three_turns()
    assert a.parent is None and b.parent is a and c.parent is b
    assert cache.find_parent([user("q"), bot("a1"), user("other")]) is a
    assert cache.find_parent([user("q")]) is None  # the same request again is a sibling, not a child
    assert cache.find_parent([user("q"), bot("a2"), user("more")]) is None  # a different reply is no prefix


def test_rewards_discount_back_through_the_conversation() -> None:
    cache, _ = three_turns()
    cache.set_reward(1.0)  # the last completion
    assert cache.returns(0.9) == pytest.approx({"i2": 1.0, "i1": 0.9, "i0": 0.81})
    cache.set_reward(0.5, "i1")
    assert cache.returns(0.9) == pytest.approx({"i2": 1.0, "i1": 1.4, "i0": 1.26})


def test_a_branch_averages_its_continuations() -> None:
    cache, (a, b, c) = three_turns()
    m = [user("q"), bot("a1"), user("more")]
    d = make(cache, m, "b2", [1, 5, 6, 7, 8], [13], cache.find_parent(m))
    assert d.parent is a and a.children == [b, d]
    cache.set_reward(1.0, c.id)
    cache.set_reward(0.0, d.id)
    assert cache.returns(0.5)["i0"] == pytest.approx(0.5 * (0.5 + 0.0) / 2)


def test_set_reward_names_what_is_wrong() -> None:
    cache = InteractionCache()
    with pytest.raises(LookupError, match="no completion"):
        cache.set_reward(1.0)
    make(cache, [user("q")], "a", [1], [2])
    with pytest.raises(KeyError, match="nope"):
        cache.set_reward(1.0, "nope")
    with pytest.raises(ValueError, match="finite number"):
        cache.set_reward(float("nan"))


# ------------------------------------------------------------------------------------ export


def test_individual_export_is_one_sample_per_completion_with_its_own_tokens() -> None:
    cache, (_, b, _) = three_turns()
    cache.set_reward(1.0)
    samples = export_session(cache, 0.9, "individual")
    assert list(samples) == ["i0", "i1", "i2"]
    row = samples["i1"].as_json()
    assert row["input_ids"] == b.prompt_ids + b.output_ids and row["loss_mask"] == [0] * 5 + [1]
    assert row["logprobs"][-1] == b.output_logprobs[0] and row["versions"] == [-1] * 5 + [1]
    tensors = interactions_to_tensors(samples)
    assert tensors["input_ids"].shape == (3, 9) and tensors["rewards"].tolist() == pytest.approx([0.81, 0.9, 1.0])


def test_concat_export_is_the_whole_linear_conversation_once() -> None:
    cache, (_, _, c) = three_turns()
    cache.set_reward(1.0)
    [(leaf, sample)] = export_session(cache, 0.9, "concat").items()
    row = sample.as_json()
    assert leaf == "i2" and row["input_ids"] == c.prompt_ids + c.output_ids
    assert row["loss_mask"] == [0, 0, 1, 1, 0, 1, 0, 1, 1]
    assert row["versions"] == [-1, -1, 0, 0, -1, 1, -1, 2, 2] and row["reward"] == 1.0 and row["prompt_len"] == 2


def test_concat_refuses_a_branching_conversation_and_edited_history() -> None:
    cache, (a, _, _) = three_turns()
    make(cache, [user("q"), bot("a1"), user("more")], "b2", [1, 5, 6, 7, 8], [13], a)
    with pytest.raises(ExportError, match="branches into 2 continuations"):
        export_session(cache, 1.0, "concat")
    cache2 = InteractionCache()
    first = make(cache2, [user("q")], "a1", [1, 5], [6, 7])
    make(cache2, [user("q"), bot("a1"), user("x")], "z", [1, 5, 6, 99, 8], [3], first)  # tokens re-rendered
    with pytest.raises(ExportError, match="does not start with the tokens"):
        export_session(cache2, 1.0, "concat")


# ------------------------------------------------------------------------------------ prompt tokens


def test_glue_is_what_the_template_adds_after_the_generated_stop() -> None:
    assert glue_after("<|im_end|>\n", "hello<|im_end|>") == "\n"
    assert glue_after("<|im_end|>\n", "hello") == "<|im_end|>\n"
    assert glue_after("", "hello<eos>") == ""


def test_a_continuation_extends_the_parents_exact_tokens(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    chat = ChatTokenizer(tok)
    first, incremental = chat.prompt_ids([user("12=")], None, None)
    assert first == tok("<bos>12=", add_special_tokens=False).input_ids and not incremental
    cache = InteractionCache()
    # the model's own tokens, an <eos> included, which the template would never render
    parent = make(cache, [user("12=")], "1z", first, [*tok("1z", add_special_tokens=False).input_ids, tok.eos_token_id])
    ids, incremental = chat.prompt_ids([user("12="), bot("1z"), user("again:")], None, parent)
    assert incremental and ids == parent.full_ids + tok("again:", add_special_tokens=False).input_ids
    # history the agent rewrote: tokenized afresh, and not incremental (concat will refuse it)
    ids, incremental = chat.prompt_ids([user("12="), bot("edited"), user("again:")], None, parent)
    assert not incremental and ids == tok("<bos>12=editedagain:", add_special_tokens=False).input_ids


# ------------------------------------------------------------------------------ stops and constraints


def test_a_stop_string_cuts_the_text_before_it_and_the_tokens_after_it(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    chat = ChatTokenizer(tok)
    ids = chat.encode("ab+cd+ef")  # a server that did not apply the stop: tokens after it came back too
    cut = cut_at_stop(ids, ["d+", "+c"], chat.decode)
    assert (cut.keep, cut.text, cut.matched) == (4, "ab", "+c")  # the first stop to appear, cut where it starts
    assert cut_at_stop(ids[: cut.keep], ["d+", "+c"], chat.decode) == cut  # a server that did cut: the same
    assert cut_at_stop(ids, ["zz"], chat.decode) == StopCut(len(ids), "ab+cd+ef", None)
    assert cut_at_stop([*ids, tok.eos_token_id], [], chat.decode).keep == len(ids) + 1


def test_constraints_are_met_by_a_valid_call_or_json_and_missed_otherwise() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}},
             {"type": "function", "function": {"name": "mul", "parameters": {}}}]
    _, [add] = parse_tool_calls(format_tool_call("add", {"a": 1}))
    named = parse_tool_choice({"type": "function", "function": {"name": "add"}}, tools, "chat")
    assert named == parse_tool_choice({"type": "tool", "name": "add"}, tools, "messages") == ToolChoice("named", "add")
    assert parse_tool_choice({"type": "any"}, tools, "messages") == parse_tool_choice("required", tools, "chat")
    assert unmet("", [add], tools, named, ResponseFormat()) is None
    assert unmet("", [add], tools, ToolChoice("named", "mul"), ResponseFormat()) == "tool_choice 'mul': the completion calls 'add'"
    assert "needs a tool call" in str(unmet("42", [], tools, ToolChoice("required"), ResponseFormat()))
    schema = parse_response_format({"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}}}, "response_format")
    assert unmet('{"sum": 3}', [], None, ToolChoice(), schema) is None
    assert "'sum' is a required property" in str(unmet('{"total": 3}', [], None, ToolChoice(), schema))
    assert "needs a JSON object" in str(unmet("[1]", [], None, ToolChoice(), ResponseFormat("json_object")))
    assert unmet("not json", [], None, ToolChoice(), ResponseFormat()) is None


def test_streamed_pieces_always_join_to_the_answered_content(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(tiny_model))
    cache = InteractionCache()
    item = make(cache, [user("1=")], "x", [1], [*chat.encode("12 ab"), chat.eos_token_id or 0])
    assert content_pieces("12 ab", item, chat) == ["1", "2", " ", "a", "b", ""]
    assert "".join(content_pieces("12", item, chat)) == "12"  # cut at a stop: the text is shorter than the tokens
    assert "".join(content_pieces("tool text", item, chat)) == "tool text"  # content rebuilt around tool calls


def test_streamed_events_rebuild_text_and_tool_calls_in_the_sdks_own_accumulators(tiny_model: Path) -> None:
    """A completion with text and a tool call, streamed in each dialect and fed to the official SDKs'
    stream accumulators (what their `.stream()` helpers use), comes back as the non-streamed answer."""
    import anthropic
    from anthropic._models import construct_type as anthropic_type
    from anthropic.lib.streaming._messages import accumulate_event
    from openai._models import construct_type as openai_type
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.chat import ChatCompletionChunk
    from openai.types.responses import ResponseStreamEvent
    from transformers import AutoTokenizer

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(tiny_model))
    item = make(InteractionCache(), [user("1=")], "12 ab", [1], [*chat.encode("12 ab"), chat.eos_token_id or 0])
    [call] = parse_tool_calls(format_tool_call("add", {"a": 1}), id_prefix="call_x")[1]
    item.reply["tool_calls"] = [call.openai()]
    request = parse_chat({"messages": [user("1=")], "logprobs": True})

    state = ChatCompletionStreamState()
    for _, data in streaming.chat_events([item], request, chat):
        if data != "[DONE]":
            state.handle_chunk(ChatCompletionChunk.model_validate(data))
    [choice] = state.get_final_completion().choices
    assert choice.message.content == "12 ab" and choice.finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()] == [("call_x_0", "add", '{"a": 1}')]
    assert choice.logprobs is not None and [e.logprob for e in choice.logprobs.content or ()] == item.output_logprobs

    responses = ResponseStreamState(input_tools=[], text_format=openai.NOT_GIVEN)
    events = [openai_type(type_=ResponseStreamEvent, value=data) for _, data in streaming.responses_events(item, request, chat)]
    for event in events:
        responses.handle_event(event)
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == "12 ab" and [o.type for o in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == '{"a": 1}'  # type: ignore[union-attr]

    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for _, data in streaming.anthropic_events(item, request, chat):
        event = anthropic_type(type_=anthropic.types.RawMessageStreamEvent, value=data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot is not None and snapshot.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in snapshot.content] == [
        ("text", "12 ab", None), ("tool_use", None, {"a": 1})]


def test_areals_creation_order_discount_is_offered_beside_the_tree() -> None:
    cache, (_, _, c) = three_turns()
    m = [user("q"), bot("a1"), user("more")]
    make(cache, m, "b2", [1, 5, 6, 7, 8], [13], cache.find_parent(m))  # a branch: i3, made last
    cache.set_reward(1.0, c.id)
    # AReaL's rule: back through creation order (i3, i2, i1, i0), whatever the tree
    assert cache.returns(0.5, "creation_order") == pytest.approx({"i3": 0.0, "i2": 1.0, "i1": 0.5, "i0": 0.25})
    assert cache.returns(0.5)["i0"] == pytest.approx(0.5 * (0.5 * 1.0 + 0.0) / 2)  # jetrl's tree: the branch averaged
    with pytest.raises(ValueError, match="discount rule must be one of"):
        cache.returns(0.5, "linear")
    assert c.model_response.output_tokens == [11, 12] and c.model_response.input_len == 7
