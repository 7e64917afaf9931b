"""The agent proxy's Chat Completions endpoint driven by the real `openai` SDK against the real CPU
inference server: streaming (raw chunks and the SDK's stream helper), n=2, stop strings, logprobs,
every tool_choice, response_format; the export holds exactly the engine's tokens."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from services.rollout.agent.server import ProxyServer
from tests.support import agent
from tests.support.agent import RecordingEngine, assert_export_is_the_engines, seeded_stop, session

# fixtures: the module's inference server, the recording engine, a proxy whose template shows the tools
inference_url, engine, tokenizer, server = agent.inference_url, agent.engine, agent.tokenizer, agent.server

ASK = [{"role": "user", "content": "12+3="}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "sum",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


client = agent.openai_client


async def test_streamed_chat_completions_answer_and_record_what_the_plain_call_does(server: ProxyServer, engine: RecordingEngine) -> None:
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        oai = client(server, sid, http)
        plain = await oai.chat.completions.create(model="p", messages=ASK, temperature=0, max_tokens=6)
        stream = await oai.chat.completions.create(model="p", messages=ASK, temperature=0, max_tokens=6, stream=True,
                                                   stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == plain.choices[0].message.content == server.proxy.chat.decode(engine.calls[1].output_ids)
        assert len({c.id for c in chunks}) == 1 and chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(engine.calls[1].output_ids)
        async with oai.chat.completions.stream(model="p", messages=ASK, temperature=0, max_tokens=6) as helper:
            deltas = [e.delta async for e in helper if e.type == "content.delta"]
            final = helper.current_completion_snapshot  # get_final_completion() refuses a length finish
        assert "".join(deltas) == final.choices[0].message.content == plain.choices[0].message.content
        cache = server.proxy.sessions[sid].cache
        assert cache.get(chunks[0].id) is not None and cache.get(final.id) is not None
        await assert_export_is_the_engines(http, server, sid, engine.calls)


async def test_n_2_answers_two_choices_each_recorded(server: ProxyServer, engine: RecordingEngine) -> None:
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        oai = client(server, sid, http)
        resp = await oai.chat.completions.create(model="p", messages=ASK, n=2, max_tokens=5, seed=3)
        assert [c.index for c in resp.choices] == [0, 1] and len(engine.calls) == 2
        assert resp.usage is not None and resp.usage.completion_tokens == sum(len(c.output_ids) for c in engine.calls)
        texts = sorted(c.message.content or "" for c in resp.choices)
        assert texts == sorted(server.proxy.chat.decode(c.output_ids) for c in engine.calls)
        cache = server.proxy.sessions[sid].cache
        assert cache.get(resp.id) is not None and cache.get(f"{resp.id}-1") is not None
        stream = await oai.chat.completions.create(model="p", messages=ASK, n=2, max_tokens=5, stream=True)
        indices = {c.choices[0].index async for c in stream if c.choices}
        assert indices == {0, 1}
        rows = await assert_export_is_the_engines(http, server, sid, engine.calls)
        assert len(rows) == 4


async def test_stop_strings_are_cut_from_the_text_and_the_record(server: ProxyServer, engine: RecordingEngine) -> None:
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        oai = client(server, sid, http)
        extra, expected = await seeded_stop(oai, ASK)
        [stop] = extra["stop"]
        ask: dict[str, Any] = {"model": "p", "messages": ASK, "temperature": 1, "max_tokens": 12, "seed": extra["seed"]}
        cut = await oai.chat.completions.create(**ask, stop=[stop, "never"])
        assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
        stream = await oai.chat.completions.create(**ask, stop=stop, stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == expected
        item = server.proxy.sessions[sid].cache.get(cut.id)
        assert item is not None and item.stop_sequence == stop
        assert server.proxy.chat.decode(item.output_ids) == expected + stop  # the stop string's tokens stay recorded
        await assert_export_is_the_engines(http, server, sid, engine.calls)


async def test_logprobs_and_top_logprobs_are_the_engines(server: ProxyServer, engine: RecordingEngine) -> None:
    chat = server.proxy.chat
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        oai = client(server, sid, http)
        ask: dict[str, Any] = {"model": "p", "messages": ASK, "max_tokens": 5, "seed": 7, "logprobs": True, "top_logprobs": 3}
        resp = await oai.chat.completions.create(**ask)
        got = resp.choices[0].logprobs
        assert got is not None and got.content is not None
        call = engine.calls[0]
        assert [e.logprob for e in got.content] == call.output_logprobs
        for entry, tok, logprob in zip(got.content, call.output_ids, call.output_logprobs, strict=True):
            top = entry.top_logprobs
            assert len(top) == 3 and len({t.token for t in top}) == 3  # the real top 3, not the sampled token thrice
            assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
            assert all(t.bytes == list(t.token.encode()) for t in top)
            sampled = chat.decode([tok], skip_special_tokens=False)
            assert entry.token == sampled and all(t.logprob == logprob for t in top if t.token == sampled)
        assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in got.content] == [
            [(chat.decode([t], skip_special_tokens=False), lp) for t, lp in row] for row in call.output_top_logprobs]
        stream = await oai.chat.completions.create(**ask, stream=True)  # same seed: same tokens, same top 3
        streamed = [e async for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or ()]
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in got.content]
        plain = await oai.chat.completions.create(model="p", messages=ASK, max_tokens=5)
        assert plain.choices[0].logprobs is None and not engine.calls[2].output_top_logprobs
        with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
            await oai.chat.completions.create(model="p", messages=ASK, top_logprobs=2)


async def test_tool_choice_is_honoured_or_refused(server: ProxyServer, engine: RecordingEngine, tokenizer: Any) -> None:
    chat = server.proxy.chat
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        oai = client(server, sid, http)
        await oai.chat.completions.create(model="p", messages=ASK, tools=TOOLS, max_tokens=3)
        assert engine.calls[-1].input_ids == chat.encode(chat.render([*ASK], TOOLS, True))  # auto: the tools are offered
        none = await oai.chat.completions.create(model="p", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=3)
        assert engine.calls[-1].input_ids == chat.encode(chat.render([*ASK], None, True))  # none: not offered
        assert none.choices[0].message.tool_calls is None
        for choice, prefill in (("required", "<tool_call>"), ({"type": "function", "function": {"name": "add"}}, "<tool_call>")):
            # the call's grammar is enforced while decoding: the tiny vocabulary cannot spell '{', so the
            # server refuses it by name (tests/integration/test_agent_constrained.py: the ASCII model)
            with pytest.raises(openai.BadRequestError, match="admits no token of this model's vocabulary"):
                await oai.chat.completions.create(model="p", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=3)
            asked = engine.requests[-1]
            assert asked.input_ids == chat.encode(chat.render([*ASK], TOOLS, True)) + chat.encode(prefill)
            assert asked.json_schema is not None and '"add"' in asked.json_schema
        with pytest.raises(openai.BadRequestError, match="not among the tools"):
            await oai.chat.completions.create(model="p", messages=ASK, tools=TOOLS,
                                              tool_choice={"type": "function", "function": {"name": "mul"}})
        with pytest.raises(openai.BadRequestError, match="needs tools"):
            await oai.chat.completions.create(model="p", messages=ASK, tool_choice="required")
        await assert_export_is_the_engines(http, server, sid, engine.calls)  # the refused completions are recorded too


async def test_response_format_is_validated_never_ignored(server: ProxyServer, engine: RecordingEngine) -> None:
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        oai = client(server, sid, http)
        with pytest.raises(openai.BadRequestError, match="admits no token"):  # the tiny vocabulary has no '{'
            await oai.chat.completions.create(model="p", messages=ASK, response_format={"type": "json_object"}, max_tokens=4)
        assert engine.requests[-1].json_schema == '{"type": "object"}'
        schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}
        with pytest.raises(openai.BadRequestError, match="json grammar admits no token"):
            await oai.chat.completions.create(model="p", messages=ASK, max_tokens=4,
                                              response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        with pytest.raises(openai.BadRequestError, match="not a valid JSON schema"):
            await oai.chat.completions.create(model="p", messages=ASK, max_tokens=4,
                                              response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 5}}})
        with pytest.raises(openai.BadRequestError, match="response_format: type must be"):
            await oai.chat.completions.create(model="p", messages=ASK, response_format={"type": "grammar"})  # type: ignore[arg-type]
        text = await oai.chat.completions.create(model="p", messages=ASK, response_format={"type": "text"}, max_tokens=4)
        assert text.choices[0].message.content == server.proxy.chat.decode(engine.calls[-1].output_ids)
