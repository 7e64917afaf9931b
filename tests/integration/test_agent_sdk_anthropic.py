"""The agent proxy's Anthropic Messages endpoint with the real `anthropic` SDK against the real CPU
inference server: `stream=True` events and the `messages.stream()` helper, stop_sequences
(stop_reason "stop_sequence" and the matched sequence), `count_tokens`, every tool_choice; the export
holds exactly the engine's tokens."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from services.rollout.agent.server import ProxyServer
from tests.support import agent
from tests.support.agent import RecordingEngine, assert_export_is_the_engines, seeded_stop, session

# fixtures: the module's inference server, the recording engine, a proxy whose template shows the tools
inference_url, engine, tokenizer, server = agent.inference_url, agent.engine, agent.tokenizer, agent.server

ASK: list[Any] = [{"role": "user", "content": "40+2="}]
TOOLS: list[Any] = [{"name": "add", "description": "sum", "input_schema": {"type": "object", "properties": {}}}]


def claude(srv: ProxyServer, sid: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=f"{srv.url}/{sid}", api_key="x", max_retries=0)


async def test_streamed_messages_and_the_stream_helper_answer_as_the_plain_call(server: ProxyServer, engine: RecordingEngine) -> None:
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        api = claude(server, sid)
        plain = await api.messages.create(model="p", max_tokens=6, messages=ASK, extra_body={"temperature": 0})
        stream = await api.messages.create(model="p", max_tokens=6, messages=ASK, extra_body={"temperature": 0}, stream=True)
        events = [e async for e in stream]
        assert [events[0].type, events[-1].type, events[-2].type] == ["message_start", "message_stop", "message_delta"]
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
        assert text == plain.content[0].text == server.proxy.chat.decode(engine.calls[1].output_ids)  # type: ignore[union-attr]
        assert events[-2].delta.stop_reason == plain.stop_reason == "max_tokens"  # type: ignore[union-attr]
        async with api.messages.stream(model="p", max_tokens=6, messages=ASK, extra_body={"temperature": 0}) as helper:
            helped = [t async for t in helper.text_stream]
            final = await helper.get_final_message()
        assert "".join(helped) == final.content[0].text == text and final.usage.output_tokens == len(engine.calls[2].output_ids)  # type: ignore[union-attr]
        await assert_export_is_the_engines(http, server, sid, engine.calls)


async def test_stop_sequences_are_cut_and_reported(server: ProxyServer, engine: RecordingEngine) -> None:
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        oai = openai.AsyncOpenAI(base_url=server.base_url(sid), api_key="x", http_client=http, max_retries=0)
        extra, expected = await seeded_stop(oai, ASK)
        [stop] = extra["stop"]
        # the same prompt and sampling (`seed`, and `temperature` in this SDK version, through extra_body)
        api = claude(server, sid)
        msg = await api.messages.create(model="p", max_tokens=12, messages=ASK, stop_sequences=["never", stop],
                                        extra_body={"seed": extra["seed"], "temperature": 1})
        assert msg.content[0].text == expected  # type: ignore[union-attr]
        assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
        async with api.messages.stream(model="p", max_tokens=12, messages=ASK, stop_sequences=[stop],
                                       extra_body={"seed": extra["seed"], "temperature": 1}) as helper:
            final = await helper.get_final_message()
        assert (final.content[0].text, final.stop_reason, final.stop_sequence) == (expected, "stop_sequence", stop)  # type: ignore[union-attr]
        await assert_export_is_the_engines(http, server, sid, engine.calls)


async def test_count_tokens_is_the_prompt_a_completion_gets(server: ProxyServer, engine: RecordingEngine) -> None:
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        api = claude(server, sid)
        asks: list[Any] = [ASK, [{"role": "user", "content": [{"type": "text", "text": "9="}]}]]
        for messages in asks:
            counted = await api.messages.count_tokens(model="p", system="sum", messages=messages, tools=TOOLS)
            await api.messages.create(model="p", max_tokens=2, system="sum", messages=messages, tools=TOOLS)
            assert counted.input_tokens == len(engine.calls[-1].input_ids)
        with pytest.raises(anthropic.BadRequestError, match="messages must be a non-empty list"):
            await api.messages.count_tokens(model="p", messages=[])


async def test_tool_choice_none_any_and_named(server: ProxyServer, engine: RecordingEngine) -> None:
    chat = server.proxy.chat
    prompt = chat.render(ASK, None, True)
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        api = claude(server, sid)
        none = await api.messages.create(model="p", max_tokens=3, messages=ASK, tools=TOOLS, tool_choice={"type": "none"})
        assert engine.calls[-1].input_ids == chat.encode(prompt) and none.stop_reason != "tool_use"
        named = "<tool_call>"  # the grammar then holds the completion to a call of the named tool
        for choice, prefill in (({"type": "any"}, "<tool_call>"), ({"type": "tool", "name": "add"}, named)):
            with pytest.raises(anthropic.BadRequestError, match="admits no token"):  # the tiny vocabulary has no '{'
                await api.messages.create(model="p", max_tokens=3, messages=ASK, tools=TOOLS, tool_choice=choice)  # type: ignore[arg-type]
            offered = chat.render(ASK, chat_tools(), True)
            assert engine.requests[-1].input_ids == chat.encode(offered) + chat.encode(prefill)
        with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
            await api.messages.create(model="p", max_tokens=3, messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "mul"})
        await assert_export_is_the_engines(http, server, sid, engine.calls)


def chat_tools() -> list[dict[str, Any]]:
    """TOOLS as the proxy hands them to the chat template (OpenAI function format)."""
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
            for t in TOOLS]
