"""Shared parts of the agent proxy's SDK tests: a proxy over the real CPU inference server whose chat
template renders the offered tools (so what the model was told is visible in the prompt ids), and
the check that a session's export holds exactly the engine's tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.rollout.agent.proxy import AgentProxy, SamplingDefaults
from services.rollout.agent.server import ProxyServer
from services.rollout.engine import ModelResponse
from tests.integration.test_agent_proxy import RecordingEngine

# the tiny model's template (bos + contents) with the offered tools' names in front; only characters
# of its vocabulary, so the prompt ids show whether the model was told about the tools
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}={% endif %}"
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
)


@pytest.fixture
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


@pytest.fixture
async def server(engine: RecordingEngine, tokenizer: Any) -> AsyncIterator[ProxyServer]:
    srv = ProxyServer(AgentProxy(engine, tokenizer, SamplingDefaults(max_new_tokens=8)))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.aclose()


async def session(http: httpx.AsyncClient, srv: ProxyServer) -> str:
    resp = await http.post(f"{srv.url}/rl/start_session", json={"task_id": "sdk"})
    assert resp.status_code == 200
    return str(resp.json()["session_id"])


def sequence(call: ModelResponse) -> tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]:
    return tuple(call.input_ids + call.output_ids), tuple(call.output_logprobs), tuple(call.output_versions)


async def assert_export_is_the_engines(http: httpx.AsyncClient, srv: ProxyServer, sid: str, calls: list[ModelResponse]) -> dict[str, Any]:
    """Export the session (individual): one row per engine call, holding that call's exact prompt and
    completion ids, logprobs and versions. Returns the rows."""
    resp = await http.post(f"{srv.url}/export_trajectories", json={"session_id": sid})
    assert resp.status_code == 200, resp.text
    rows: dict[str, Any] = resp.json()["interactions"]
    got = []
    for row in rows.values():
        start = row["prompt_len"]
        got.append((tuple(row["input_ids"]), tuple(row["logprobs"][start:]), tuple(row["versions"][start:])))
    assert sorted(got) == sorted(sequence(c) for c in calls)
    return rows


SEED = 11


async def seeded_stop(oai: Any, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """`extra_body` (seed, stop) under which a completion of `messages` ends on a stop string, not on
    its length limit (the random tiny model never ends a turn by itself), and the text it answers then.
    Found with one seeded chat completion (recorded in the session like any other)."""
    free = await oai.chat.completions.create(model="p", messages=messages, seed=SEED, temperature=1, max_tokens=12)
    text = free.choices[0].message.content or ""
    assert len(text) >= 6, text
    stop = text[3:5]
    expected = text[: text.find(stop)]
    assert expected, f"pick another SEED: {text!r} starts with its stop string"
    return {"seed": SEED, "stop": [stop]}, expected
