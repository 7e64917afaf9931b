"""The agent proxy's Responses endpoint with the real `openai` SDK (raw events and the stream helper,
logprobs, tool_choice, text.format), and the frameworks built on the OpenAI protocol: `openai-agents`
(`Runner.run` and `Runner.run_streamed`, on the Responses and the Chat Completions model) and
`langchain-openai` (`invoke` and `stream`). The export holds exactly the engine's tokens."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from services.rollout.agent.server import ProxyServer
from tests.support import agent
from tests.support.agent import RecordingEngine, assert_export_is_the_engines, seeded_stop, session

# fixtures: the module's inference server, the recording engine, a proxy whose template shows the tools
inference_url, engine, tokenizer, server = agent.inference_url, agent.engine, agent.tokenizer, agent.server

TOOLS = [{"type": "function", "name": "add", "description": "sum", "parameters": {"type": "object", "properties": {}}}]


client = agent.openai_client


async def test_streamed_responses_answer_and_record_what_the_plain_call_does(server: ProxyServer, engine: RecordingEngine) -> None:
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        oai = client(server, sid, http)
        # a turn that ends on a stop string: the SDK's stream helper wants `response.completed`
        extra, expected = await seeded_stop(oai, [{"role": "user", "content": "7*3="}])
        ask: dict[str, Any] = {"model": "p", "input": "7*3=", "temperature": 1, "max_output_tokens": 12, "extra_body": extra}
        plain = await oai.responses.create(**ask)
        stream = await oai.responses.create(**ask, stream=True)
        events = [e async for e in stream]
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == plain.output_text == expected and plain.status == "completed"
        final = events[-1].response  # type: ignore[union-attr]
        assert final.output_text == text and final.usage is not None and final.usage.output_tokens == len(engine.calls[2].output_ids)
        async with oai.responses.stream(**ask) as helper:
            helped = [e.delta async for e in helper if e.type == "response.output_text.delta"]
            done = await helper.get_final_response()
        assert "".join(helped) == done.output_text == expected
        follow = await oai.responses.create(model="p", input="more", previous_response_id=done.id, stream=True, max_output_tokens=3)
        last = [e async for e in follow][-1]
        assert last.type == "response.incomplete"  # cut by max_output_tokens: what the API says then
        cache = server.proxy.sessions[sid].cache
        assert cache.get(last.response.id).parent is cache.get(done.id)  # type: ignore[union-attr]
        await assert_export_is_the_engines(http, server, sid, engine.calls)


async def test_responses_logprobs_tool_choice_and_text_format(server: ProxyServer, engine: RecordingEngine) -> None:
    chat = server.proxy.chat
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        oai = client(server, sid, http)
        resp = await oai.responses.create(model="p", input="5=", max_output_tokens=4, include=["message.output_text.logprobs"],
                                          top_logprobs=1)
        part = resp.output[0].content[0]  # type: ignore[union-attr]
        assert [e.logprob for e in part.logprobs] == engine.calls[-1].output_logprobs  # type: ignore[union-attr]
        await oai.responses.create(model="p", input="5=", tools=TOOLS, tool_choice="none", max_output_tokens=3)  # type: ignore[arg-type]
        assert engine.calls[-1].input_ids == chat.encode(chat.render([{"role": "user", "content": "5="}], None, True))
        # enforced while decoding: the tiny vocabulary cannot spell '{' (test_agent_constrained.py: the ASCII model)
        with pytest.raises(openai.BadRequestError, match="admits no token"):
            await oai.responses.create(model="p", input="5=", tools=TOOLS, tool_choice={"type": "function", "name": "add"},  # type: ignore[arg-type]
                                       max_output_tokens=3)
        with pytest.raises(openai.BadRequestError, match="admits no token"):
            await oai.responses.create(model="p", input="5=", text={"format": {"type": "json_object"}}, max_output_tokens=3)
        await assert_export_is_the_engines(http, server, sid, engine.calls)


async def test_openai_agents_run_and_run_streamed(server: ProxyServer, engine: RecordingEngine) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # the SDK would send traces to api.openai.com
    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        oai = client(server, sid, http)
        extra, expected = await seeded_stop(oai, [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="}])
        settings = ModelSettings(max_tokens=12, temperature=1, extra_body=extra)
        for model in (OpenAIResponsesModel(model="p", openai_client=oai), OpenAIChatCompletionsModel(model="p", openai_client=oai)):
            agent = Agent(name="calc", instructions="add", model=model, model_settings=settings)
            ran = await Runner.run(agent, "1+1=")
            streamed = Runner.run_streamed(agent, "1+1=")
            deltas = [e.data.delta async for e in streamed.stream_events()
                      if e.type == "raw_response_event" and getattr(e.data, "type", "") == "response.output_text.delta"]
            assert streamed.final_output == ran.final_output == "".join(deltas) == expected
        assert len(engine.calls) == 5

        @function_tool
        def add(a: int, b: int) -> int:
            """Sum two numbers."""
            return a + b

        chat = server.proxy.chat
        asked = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="}]
        model = OpenAIResponsesModel(model="p", openai_client=oai)
        quiet = Agent(name="calc", instructions="add", model=model, tools=[add], model_settings=replace(settings, tool_choice="none"))
        assert (await Runner.run(quiet, "1+1=")).final_output == expected
        assert engine.calls[-1].input_ids == chat.encode(chat.render(asked, None, True))  # the tool was not offered
        eager = Agent(name="calc", instructions="add", model=model, tools=[add], model_settings=replace(settings, tool_choice="add"))
        with pytest.raises(openai.BadRequestError, match="admits no token"):  # the tiny vocabulary has no '{'
            await Runner.run(eager, "1+1=")
        offered = chat.render(asked, [{"type": "function", "function": {"name": "add"}}], True)  # the template shows names only
        assert engine.requests[-1].input_ids == chat.encode(offered) + chat.encode("<tool_call>")
        await assert_export_is_the_engines(http, server, sid, engine.calls)


async def test_langchain_invoke_and_stream(server: ProxyServer, engine: RecordingEngine) -> None:
    from langchain_openai import ChatOpenAI

    async with httpx.AsyncClient() as http:
        sid = await session(http, server)
        llm = ChatOpenAI(model="p", base_url=server.base_url(sid), api_key="x", max_tokens=4, temperature=0,  # type: ignore[arg-type]
                         max_retries=0, stop_sequences=None)
        # the blocking client, in a thread: the proxy runs on this loop
        invoked = await asyncio.to_thread(llm.invoke, "2*2=")
        chunks: list[Any] = await asyncio.to_thread(lambda: list(llm.stream("2*2=")))
        assert "".join(str(c.content) for c in chunks) == invoked.content == server.proxy.chat.decode(engine.calls[0].output_ids)
        streamed = [c async for c in llm.astream("2*2=", logprobs=True)]
        assert sum(len(c.response_metadata.get("logprobs", {}).get("content") or []) for c in streamed) == len(engine.calls[2].output_ids)
        # stop strings and tool_choice as LangChain sends them
        extra, expected = await seeded_stop(client(server, sid, http), [{"role": "user", "content": "2*2="}])
        sampled = ChatOpenAI(model="p", base_url=server.base_url(sid), api_key="x", max_tokens=12, temperature=1,  # type: ignore[arg-type]
                             seed=extra["seed"], max_retries=0)
        assert "".join([str(c.content) async for c in sampled.astream("2*2=", stop=extra["stop"])]) == expected
        adder = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
        chat = server.proxy.chat
        quiet = await llm.bind_tools([adder], tool_choice="none").ainvoke("2*2=")
        unoffered = chat.encode(chat.render([{"role": "user", "content": "2*2="}], None, True))
        assert not quiet.tool_calls and engine.calls[-1].input_ids == unoffered
        with pytest.raises(openai.BadRequestError, match="admits no token"):  # enforced; the tiny vocabulary has no '{'
            await llm.bind_tools([adder], tool_choice="add").ainvoke("2*2=")
        await assert_export_is_the_engines(http, server, sid, engine.calls)
