"""Structured output through the agent proxy with the official `openai` SDK, enforced while decoding by
the real CPU inference server on a tiny model that can spell JSON (`make-model --vocab ascii`; the
default vocabulary has no braces or quotes): `response_format` json_schema and json_object, `tool_choice`
required and named, each 20 of 20 valid, streamed and not (20 choices of one request: one batch on the
server), the Responses API's `text.format`; the export holds exactly the tokens sampled under the
constraint; a completion cut by max_tokens is still answered 422.

The model is random, so a JSON object without a schema may run long: requests are seeded (the CPU
server honours `sampling_seed`, each choice with seed + i), which makes every try reproducible."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from services.common.nats_server import free_port
from services.rollout.agent.proxy import AgentProxy, SamplingDefaults
from services.rollout.agent.server import ProxyServer
from services.rollout.client_settings import InferenceClientSettings
from tests.support.agent import ROOT, RecordingEngine, assert_export_is_the_engines, openai_client, running, session
from tests.support.waiting import wait_http_ok

TRIES = 20
ASK = [{"role": "user", "content": "12+3="}]
SCHEMA = {"type": "object", "properties": {"sum": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
          "required": ["sum", "ok"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["paris", "rome"]}}, "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "sum", "parameters": ADD}},
         {"type": "function", "function": {"name": "weather", "description": "forecast", "parameters": CITY}}]
PARAMS = {"add": ADD, "weather": CITY}


@pytest.fixture(scope="module")
def ascii_url(ascii_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("constrained-inference") / "inference.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.inference", f"model_path={ascii_model}", f"port={port}"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", timeout_s=120, proc=proc, log=log)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
async def engine(ascii_url: str) -> AsyncIterator[RecordingEngine]:
    eng = RecordingEngine(InferenceClientSettings(servers=[ascii_url]))
    try:
        yield eng
    finally:
        await eng.aclose()


@pytest.fixture
async def server(engine: RecordingEngine, ascii_model: Path) -> AsyncIterator[ProxyServer]:
    from transformers import AutoTokenizer

    async with running(AgentProxy(engine, AutoTokenizer.from_pretrained(ascii_model), SamplingDefaults(max_new_tokens=400))) as srv:
        yield srv


async def _choices(oai: openai.AsyncOpenAI, stream: bool, **ask: Any) -> list[tuple[str, list[tuple[str, str]], str | None]]:
    """TRIES choices of one request: per choice (content, [(tool name, arguments)], finish_reason)."""
    ask = {"model": "p", "messages": ASK, "n": TRIES, "seed": 5, "max_tokens": 400, **ask}
    if not stream:
        resp = await oai.chat.completions.create(**ask)
        return [(c.message.content or "", [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()],  # type: ignore[union-attr]
                 c.finish_reason) for c in resp.choices]
    text: dict[int, str] = {i: "" for i in range(TRIES)}
    calls: dict[int, list[tuple[str, str]]] = {i: [] for i in range(TRIES)}
    finish: dict[int, str | None] = {}
    async for chunk in await oai.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            calls[c.index] += [(t.function.name or "", t.function.arguments or "") for t in c.delta.tool_calls or () if t.function]
            finish[c.index] = c.finish_reason or finish.get(c.index)
    return [(text[i], calls[i], finish.get(i)) for i in range(TRIES)]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_response_formats_give_valid_json_every_time(server: ProxyServer, engine: RecordingEngine, stream: bool) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        sid = await session(http, server)
        oai = openai_client(server, sid, http)
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
        for content, calls, finish in await _choices(oai, stream, response_format=fmt):
            jsonschema.validate(json.loads(content), SCHEMA)
            assert not calls and finish == "stop"
        assert engine.requests[-1].json_schema is not None and json.loads(engine.requests[-1].json_schema) == SCHEMA
        # any JSON object: a random model's strings run long; under seeds 70..89 all 20 end within 400 tokens
        for content, _, finish in await _choices(oai, stream, response_format={"type": "json_object"}, seed=70):
            assert isinstance(json.loads(content), dict) and finish == "stop", content
        assert len(engine.calls) == 2 * TRIES
        await assert_export_is_the_engines(http, server, sid, engine.calls)  # exactly the tokens sampled under the grammar


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_required_and_named_tool_choice_give_a_valid_call_every_time(server: ProxyServer, engine: RecordingEngine,
                                                                           stream: bool) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        sid = await session(http, server)
        oai = openai_client(server, sid, http)
        for choice, names in (("required", {"add", "weather"}), ({"type": "function", "function": {"name": "weather"}}, {"weather"})):
            got = await _choices(oai, stream, tools=TOOLS, tool_choice=choice)
            for _content, calls, finish in got:
                assert finish == "tool_calls" and len(calls) == 1, (calls, finish)
                [(name, arguments)] = calls
                assert name in names
                jsonschema.validate(json.loads(arguments), PARAMS[name])
            if choice == "required":
                assert {name for _, [(name, _)], _ in got} == names  # both tools get called among the tries
        await assert_export_is_the_engines(http, server, sid, engine.calls)


async def test_responses_text_format_and_a_cut_completion(server: ProxyServer, engine: RecordingEngine) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        sid = await session(http, server)
        oai = openai_client(server, sid, http)
        fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}
        replies = await asyncio.gather(*(oai.responses.create(model="p", input="12+3=", text=fmt, max_output_tokens=400,  # type: ignore[arg-type]
                                                              extra_body={"seed": i}) for i in range(TRIES)))
        for reply in replies:
            jsonschema.validate(json.loads(reply.output_text), SCHEMA)
        unmet = server.proxy.stats.unmet
        with pytest.raises(openai.UnprocessableEntityError, match="cut by max_tokens after 3 tokens"):
            await oai.chat.completions.create(model="p", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=3)
        assert server.proxy.stats.unmet == unmet + 1  # counted: the worker reports it (test_status_constraints.py)
        with pytest.raises(openai.BadRequestError, match="cannot be combined with response_format"):
            await oai.chat.completions.create(model="p", messages=ASK, tools=TOOLS, tool_choice="required",
                                              response_format={"type": "json_object"})
        await assert_export_is_the_engines(http, server, sid, engine.calls)  # the cut completion is recorded too


async def test_the_rest_of_the_openai_surface(server: ProxyServer, engine: RecordingEngine) -> None:
    """/v1/completions (plain and streamed, recorded like a chat completion), logit_bias and the
    penalties reaching the server, responses.retrieve, the served model's name, embeddings' 501."""
    tok = server.proxy.chat.tokenizer
    x = tok.convert_tokens_to_ids("x")
    async with httpx.AsyncClient(timeout=120) as http:
        sid = await session(http, server)
        oai = openai_client(server, sid, http)
        plain = await oai.completions.create(model="gpt-4o", prompt="12+3=", max_tokens=5, seed=1, logit_bias={str(x): 100})
        assert plain.choices[0].text == "xxxxx" and plain.model == "jetrl" and plain.choices[0].finish_reason == "length"
        assert engine.requests[-1].input_ids == tok("12+3=").input_ids and engine.requests[-1].logit_bias == {x: 100.0}
        streamed = await oai.completions.create(model="p", prompt="12+3=", max_tokens=5, seed=1, stream=True)
        again = await oai.completions.create(model="p", prompt="12+3=", max_tokens=5, seed=1)
        assert "".join([c.choices[0].text async for c in streamed]) == again.choices[0].text
        penalised = await oai.chat.completions.create(model="p", messages=ASK, max_tokens=30, seed=2, frequency_penalty=2.0,
                                                      presence_penalty=2.0)
        text = penalised.choices[0].message.content or ""
        asked = engine.requests[-1]
        assert (asked.frequency_penalty, asked.presence_penalty) == (2.0, 2.0) and penalised.model == "jetrl"
        assert max(text.count(c) for c in set(text)) <= 3, text  # repeats are pushed down hard
        resp = await oai.responses.create(model="p", input="12+3=", max_output_tokens=4)
        got = await oai.responses.retrieve(resp.id)
        assert got.id == resp.id and got.output_text == resp.output_text and got.model == "jetrl"
        unstored = await oai.responses.create(model="p", input="12+3=", max_output_tokens=4, store=False)
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            await oai.responses.retrieve(unstored.id)
        with pytest.raises(openai.APIStatusError, match="embeddings are not served") as err:
            await oai.embeddings.create(model="p", input="hi")
        assert err.value.status_code == 501
        await assert_export_is_the_engines(http, server, sid, engine.calls)


async def test_the_required_tool_agent_example_gets_a_valid_call_every_time(server: ProxyServer) -> None:
    """examples/agent_tool_required.py, as a rollout worker runs it: every episode gets its one valid call."""
    from examples.agent_tool_required import RequiredToolAgent

    async with httpx.AsyncClient(timeout=120) as http:
        sids = [await session(http, server) for _ in range(8)]
        # seeded (the random model's whitespace may run long; a seed makes each episode reproducible)
        rewards = await asyncio.gather(*(RequiredToolAgent(max_tokens=400, seed=i).run(
            {"prompt": "123=", "answer": "123"}, base_url=server.base_url(sid), http_client=http) for i, sid in enumerate(sids)))
    assert all(0.0 <= r <= 1.0 for r in rewards) and server.proxy.stats.unmet == 0
