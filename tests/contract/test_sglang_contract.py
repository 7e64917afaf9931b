"""jetrl's clients judged by SGLang itself, at the newest SGLang on PyPI and the oldest jetrl supports.

The `sglang` wheel of each version is installed without dependencies into `.cache/sglang/` (see
`sglang_pkg.py`). Its route table is read from its source; its HTTP app is imported on CPU in a
subprocess (`sglang_check.py`) whose request and response models judge the traffic that jetrl's real
clients (the rollout engine, the weights agent's client, the async bench's load sampler) exchange with
the CPU server, which stands where SGLang's GPU scheduler would be.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from bench.async_speedup import requests_in_server
from services.inference.server import InferenceServer
from services.inference.settings import InferenceSettings
from services.rollout.engine import InferenceClientSettings, InferenceEngine, ModelRequest, WeightUpdateMeta
from services.rollout.sglang_protocol import model_info_path, parse_server_version
from services.weights.server_client import ServerClient, readiness_urls
from tests.contract import sglang_pkg
from tests.contract.recorder import Recorder
from tests.integration.conftest_inference import ServerProcess, running_servers

VERSIONS = [sglang_pkg.OLDEST, sglang_pkg.NEWEST]
PROMPT = [1, 5, 6, 7, 13]


def client_routes(version: str) -> dict[str, str]:
    """Every route jetrl's clients call on a server of `version`, with its method."""
    v = parse_server_version(version)
    assert v is not None
    new = v >= (0, 5, 6)
    return {
        "/generate": "POST", "/pause_generation": "POST", "/continue_generation": "POST",
        "/update_weights_from_disk": "POST", "/abort_request": "POST", "/health": "GET",
        model_info_path(v): "GET", ("/server_info" if new else "/get_server_info"): "GET",
        ("/v1/loads" if v >= (0, 5, 8) else "/get_load"): "GET",
    }


@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_serves_every_route_jetrl_calls(version: str) -> None:
    table = sglang_pkg.routes(version)
    missing = {p: m for p, m in client_routes(version).items() if m not in table.get(p, set())}
    assert not missing, f"SGLang {version} lacks {missing}"
    assert "/get_weight_version" not in client_routes(version)
    if "/ready" in table:  # the agent's readiness polls SGLang's own route first where it exists
        assert readiness_urls("http://s")[0].endswith("/ready")


def test_the_cpu_server_serves_only_routes_sglang_serves() -> None:
    table = sglang_pkg.routes(sglang_pkg.NEWEST)
    app = InferenceServer(InferenceSettings()).app()
    ours = {(r.resource.canonical, r.method) for r in app.router.routes() if r.method != "HEAD" and r.resource is not None}
    extra = sorted((p, m) for p, m in ours if m not in table.get(p, set()))
    assert not extra, f"routes SGLang {sglang_pkg.NEWEST} does not serve: {extra}"
    for gone in ("/get_weight_version", "/get_load"):
        assert gone not in table and gone not in {p for p, _ in ours}


def judge(version: str, requests: list[dict], replies: list[dict]) -> list[dict]:
    path = os.pathsep.join([str(sglang_pkg.install(version)), str(sglang_pkg.install_deps()), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "true"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("sglang_check.py"))], env=env, timeout=600,
                          input=json.dumps({"requests": requests, "replies": replies}), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == version
    return list(out["verdicts"])


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_servers(tiny_model, tmp_path_factory.mktemp("contract"), 1, "skip_tokenizer_init=true") as (s,):
        yield s


@pytest.fixture
async def recorder(server: ServerProcess) -> AsyncIterator[Recorder]:
    rec = await Recorder(server.url).start()
    yield rec
    await rec.stop()


async def drive_clients(rec: Recorder, model: Path, new_weights: Path) -> None:
    """What jetrl's clients send in a run: generation with logprobs and stop strings, the engine's and
    the agent's weight updates (abort and in_place pauses), model info, readiness, loads."""
    engine = InferenceEngine(InferenceClientSettings(servers=[rec.url], max_retries=1, tokenizer_path=str(model)))
    agent = ServerClient(rec.url, 60.0, "in_place")
    try:
        assert await agent.wait_ready(30)
        v0 = await agent.get_weight_version()
        stopped = await engine.agenerate(ModelRequest(PROMPT, max_new_tokens=12, temperature=0.0, stop=["\n", "a"], seed=1))
        assert stopped.output_ids and len(stopped.output_logprobs) == len(stopped.output_ids)
        task = asyncio.create_task(engine.agenerate(ModelRequest(PROMPT, max_new_tokens=200, ignore_eos=True)))
        async with httpx.AsyncClient() as http:
            for _ in range(2000):  # until the long request runs, so the in_place pause holds it
                if requests_in_server((await http.get(rec.url + "/v1/loads")).json()) > 0 or task.done():
                    break
                await asyncio.sleep(0.01)
            await http.get(rec.url + "/v1/models")
        await agent.pause("in_place")
        await agent.update_weights_from_disk(str(new_weights), v0 + 1)
        await agent.resume()
        await engine.update_weights(WeightUpdateMeta(path=str(model), version=v0 + 2))  # pause in abort mode, load, continue
        res = await task
        assert {v0 + 1, v0 + 2} & set(res.output_versions)
        assert await engine.get_weight_version(rec.url) == v0 + 2
    finally:
        await engine.aclose()
        await agent.aclose()


@pytest.mark.parametrize("version", [sglang_pkg.NEWEST])
async def test_sglang_accepts_what_jetrl_sends_and_what_the_cpu_server_answers(
    version: str, recorder: Recorder, tiny_model: Path, tmp_path: Path
) -> None:
    from services.inference.make_model import build_model

    await drive_clients(recorder, tiny_model, build_model(tmp_path / "seed1", seed=1))
    sent = [{"method": e.method, "path": e.path, "body": e.body} for e in recorder.exchanges if e.method in ("POST", "PUT")]
    answered = [{"path": e.path, "body": e.reply} for e in recorder.exchanges if e.path in ("/v1/loads", "/v1/models")]
    assert {s["path"] for s in sent} >= {"/generate", "/pause_generation", "/continue_generation", "/update_weights_from_disk"}
    # A control the judge must refuse: the `stop` field jetrl used to send to a --skip-tokenizer-init server.
    old = {"method": "POST", "path": "/generate", "body": {"input_ids": PROMPT, "sampling_params": {"stop": ["\n"]}}}
    verdicts = judge(version, [*sent, old], answered)
    assert verdicts[len(sent)]["ok"] is False and "skip_tokenizer_init" in verdicts[len(sent)]["error"]
    bad = [v for i, v in enumerate(verdicts) if not v["ok"] and i != len(sent)]
    assert not bad, bad
