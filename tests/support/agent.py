"""Shared parts of the agent proxy's tests: one real CPU inference server per test module, the real
inference client keeping what the server answered, a proxy over it whose chat template renders the
offered tools (so what the model was told is visible in the prompt ids), a session, an OpenAI client
of the session, and the check that a session's export holds exactly the engine's tokens.

The fixtures (`inference_url`, `engine`, `tokenizer`, `server`) are used by name: a test module
imports those it wants."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.common.ports import free_port
from services.rollout.agent.proxy import AgentProxy, SamplingDefaults
from services.rollout.agent.server import ProxyServer
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import ModelRequest, ModelResponse, SGLangClient
from tests.support.waiting import wait_http_ok

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def inference_url(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One CPU inference server for the module (ready on GET /health)."""
    port = free_port()
    log = tmp_path_factory.mktemp("agent-inference") / "inference.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.inference", f"model_path={tiny_model}", f"port={port}"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", timeout_s=120, proc=proc, log=log)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


class RecordingEngine(SGLangClient):
    """The real client, keeping what the server answered so tests can compare the export with it."""

    def __init__(self, settings: InferenceClientSettings) -> None:
        super().__init__(settings)
        self.calls: list[ModelResponse] = []
        self.requests: list[ModelRequest] = []
        """Every request asked, answered or not (a refused one has no call)."""

    async def agenerate(self, req: ModelRequest, *, episode: str | None = None) -> ModelResponse:
        self.requests.append(req)
        resp = await super().agenerate(req, episode=episode)
        self.calls.append(resp)
        return resp


@pytest.fixture
async def engine(inference_url: str) -> AsyncIterator[RecordingEngine]:
    eng = RecordingEngine(InferenceClientSettings(servers=[inference_url]))
    try:
        yield eng
    finally:
        await eng.aclose()


@contextlib.asynccontextmanager
async def running(proxy: AgentProxy) -> AsyncIterator[ProxyServer]:
    """The proxy served on a free port while the block runs."""
    srv = ProxyServer(proxy)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.aclose()


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
    async with running(AgentProxy(engine, tokenizer, SamplingDefaults(max_new_tokens=8))) as srv:
        yield srv


async def session(http: httpx.AsyncClient, srv: ProxyServer, task_id: str = "sdk") -> str:
    resp = await http.post(f"{srv.url}/rl/start_session", json={"task_id": task_id})
    assert resp.status_code == 200
    return str(resp.json()["session_id"])


def openai_client(srv: ProxyServer, sid: str, http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    """The OpenAI SDK pointed at one session of the proxy."""
    return openai.AsyncOpenAI(base_url=srv.base_url(sid), api_key="x", http_client=http, max_retries=0)


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
