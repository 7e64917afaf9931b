"""jetrl's clients judged by SGLang itself, at the newest SGLang on PyPI and the oldest jetrl supports.

The `sglang` wheel of each version is installed without dependencies into `.cache/sglang/<version>`
(see `sglang_pkg.py`). At each version: its route table is read from its source; its request and
response models judge the traffic jetrl's real clients exchange with the CPU server
(`sglang_check.py`); and its own HTTP app (`sglang_app.py`) serves jetrl's clients, the unmodified
`jetrl weights` process and the agent proxy, with the CPU server where SGLang's GPU scheduler would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.async_speedup import requests_in_server
from schemas.sglang_protocol import MIN_VERSION, MODEL_INFO, parse_server_version
from services.inference.grammar import SGLANG_NO_BACKEND
from services.inference.server import InferenceServer
from services.inference.settings import InferenceSettings
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import BadRequestError, InferenceEngine, ModelRequest, WeightUpdateMeta
from services.weights.agent.server_client import ServerClient, readiness_urls
from tests.contract import sglang_pkg
from tests.contract.recorder import Recorder
from tests.support.inference import ServerProcess, free_port, running_servers
from tests.support.waiting import wait_http_ok

VERSIONS = sglang_pkg.versions()
PROMPT = [1, 5, 6, 7, 13]
GROUP = 8

CLIENT_ROUTES = {
    "/generate": "POST", "/pause_generation": "POST", "/continue_generation": "POST",
    "/update_weights_from_disk": "POST", "/abort_request": "POST", "/health": "GET",
    MODEL_INFO: "GET", "/server_info": "GET", "/v1/loads": "GET",
}
"""Every route jetrl's clients call on a supported server, with its method (`/ready` where it exists)."""


def test_the_tier_runs_the_oldest_supported_and_the_newest_sglang() -> None:
    assert parse_server_version(sglang_pkg.OLDEST) == MIN_VERSION
    assert sglang_pkg.NEWEST == InferenceSettings().sglang_version  # the version the CPU server speaks
    if not os.environ.get("JETRL_SGLANG_VERSIONS"):
        assert VERSIONS == [sglang_pkg.OLDEST, sglang_pkg.NEWEST]


@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_serves_every_route_jetrl_calls(version: str) -> None:
    table = sglang_pkg.routes(version)
    missing = {p: m for p, m in CLIENT_ROUTES.items() if m not in table.get(p, set())}
    assert not missing, f"SGLang {version} lacks {missing}"
    assert "/get_weight_version" not in CLIENT_ROUTES
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
    env = {**os.environ, "PYTHONPATH": sglang_path(version)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("sglang_check.py"))], env=env, timeout=600,
                          input=json.dumps({"requests": requests, "replies": replies}), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == version
    return list(out["verdicts"])


def sglang_path(version: str) -> str:
    return os.pathsep.join([str(sglang_pkg.install(version)), str(sglang_pkg.install_deps()), os.environ.get("PYTHONPATH", "")])


@contextlib.contextmanager
def sglang_app(version: str, upstream: str, model: Path, log: Path) -> Iterator[str]:
    """SGLang's own HTTP app at `version` (sglang_app.py) in front of the CPU server `upstream`."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": sglang_path(version), "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("sglang_app.py")), str(port), upstream, str(model)],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + "/model_info", timeout_s=300, proc=proc, log=log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_servers(tiny_model, tmp_path_factory.mktemp("contract"), 1, "skip_tokenizer_init=true") as (s,):
        yield s


@pytest.fixture
async def recorder(server: ServerProcess) -> AsyncIterator[Recorder]:
    rec = await Recorder(server.url).start()
    yield rec
    await rec.stop()


async def wait_running(url: str, task: asyncio.Task) -> None:
    """Until the server reports a running request (the bench's load reading of `/v1/loads`)."""
    async with httpx.AsyncClient() as http:
        for _ in range(2000):
            if requests_in_server((await http.get(url + "/v1/loads")).json()) > 0 or task.done():
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the request never started running")


async def drive_clients(rec: Recorder, model: Path, new_weights: Path) -> None:
    """What jetrl's clients send in a run: generation with logprobs and stop strings, the engine's and
    the agent's weight updates (each pause mode: abort, in_place and retract, the latter two with a
    request held through the load), model info, readiness, loads."""
    engine = InferenceEngine(InferenceClientSettings(servers=[rec.url], max_retries=1, tokenizer_path=str(model)))
    agent = ServerClient(rec.url, 60.0, "in_place")
    try:
        assert await agent.wait_ready(30)
        v0 = await agent.get_weight_version()
        stopped = await engine.agenerate(ModelRequest(PROMPT, max_new_tokens=12, temperature=0.0, stop=["\n", "a"], seed=1))
        assert stopped.output_ids and len(stopped.output_logprobs) == len(stopped.output_ids)
        group = await asyncio.gather(*(engine.agenerate(ModelRequest(PROMPT, max_new_tokens=4, ignore_eos=True, seed=i))
                                       for i in range(GROUP)))  # one batched /generate
        assert all(len(r.output_ids) == 4 and r.output_versions == [v0] * 4 for r in group)
        task = asyncio.create_task(engine.agenerate(ModelRequest(PROMPT, max_new_tokens=200, ignore_eos=True)))
        await wait_running(rec.url, task)  # so the in_place pause holds it
        async with httpx.AsyncClient() as http:
            await http.get(rec.url + "/v1/models")
        await agent.pause("in_place")
        await agent.update_weights_from_disk(str(new_weights), v0 + 1)
        await agent.resume()
        res = await task
        assert res.passes == 1 and res.output_versions[0] == v0 and res.output_versions[-1] == v0 + 1  # held in place
        task = asyncio.create_task(engine.agenerate(ModelRequest(PROMPT, max_new_tokens=200, ignore_eos=True)))
        await wait_running(rec.url, task)
        await agent.pause("retract")
        await agent.update_weights_from_disk(str(model), v0 + 2)
        await agent.resume()
        res = await task
        assert res.passes == 1 and res.output_versions[0] == v0 + 1 and res.output_versions[-1] == v0 + 2  # retracted, resumed
        # the engine's update: pause in abort mode (in-flight requests return, and are continued), load, go on
        task = asyncio.create_task(engine.agenerate(ModelRequest(PROMPT, max_new_tokens=200, ignore_eos=True)))
        await wait_running(rec.url, task)
        await engine.update_weights(WeightUpdateMeta(path=str(new_weights), version=v0 + 3))
        res = await task
        assert res.passes >= 2 and res.output_versions[-1] == v0 + 3 and len(res.output_ids) == 200
        # an abort of one request by its rid: the engine continues it on the next pass
        task = asyncio.create_task(engine.agenerate(ModelRequest(PROMPT, max_new_tokens=200, ignore_eos=True, rid="one")))
        await wait_running(rec.url, task)
        async with httpx.AsyncClient() as http:
            assert (await http.post(rec.url + "/abort_request", json={"rid": "one-p1"})).status_code == 200
        res = await task
        assert res.passes >= 2 and len(res.output_ids) == 200
        assert await engine.get_weight_version(rec.url) == v0 + 3
    finally:
        await engine.aclose()
        await agent.aclose()


async def test_sglang_accepts_what_jetrl_sends_and_what_the_cpu_server_answers(
    recorder: Recorder, tiny_model: Path, tmp_path: Path
) -> None:
    """The traffic of one run of jetrl's clients, judged by the request and reply models of the newest
    version the tier runs (the CPU server answers as the newest does; at the oldest, SGLang's app itself
    parses the same requests in `test_jetrl_clients_against_sglangs_own_http_app`)."""
    from services.inference.make_model import build_model

    await drive_clients(recorder, tiny_model, build_model(tmp_path / "seed1", seed=1))
    sent = [{"method": e.method, "path": e.path, "body": e.body} for e in recorder.exchanges if e.method in ("POST", "PUT")]
    answered = [{"path": e.path, "body": e.reply} for e in recorder.exchanges if e.path in ("/v1/loads", "/v1/models")]
    assert {s["path"] for s in sent} >= {"/generate", "/pause_generation", "/continue_generation", "/update_weights_from_disk"}
    assert any(s["path"] == "/generate" and len(s["body"]["input_ids"]) == GROUP and isinstance(s["body"]["input_ids"][0], list)
               for s in sent)  # the batch form is judged too
    sent += constrained_payloads()
    sent += await finish_rules(recorder.url)
    sent += await grammar_refusals(recorder.url)
    sent += await input_refusals(recorder.url, tiny_model)
    # Controls the judge must refuse: the `stop` field jetrl used to send to a --skip-tokenizer-init
    # server, and two grammars in one request.
    old = {"method": "POST", "path": "/generate", "body": {"input_ids": PROMPT, "sampling_params": {"stop": ["\n"]}}}
    two = {"method": "POST", "path": "/generate", "body": {"input_ids": PROMPT, "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}}
    verdicts = judge(VERSIONS[-1], [*sent, old, two], answered)
    assert verdicts[len(sent)]["ok"] is False and "skip_tokenizer_init" in verdicts[len(sent)]["error"]
    assert verdicts[len(sent) + 1]["ok"] is False and "Only one of" in verdicts[len(sent) + 1]["error"]
    bad = [v for i, v in enumerate(verdicts) if not v["ok"] and i < len(sent)]
    assert not bad, bad


def constrained_payloads() -> list[dict[str, Any]]:
    """The `/generate` bodies jetrl sends for structured output: the agent proxy's tool-call and
    response_format constraints, a regex and an EBNF, alone and as one batch (judged by SGLang)."""
    from schemas.sglang_protocol import build_batch_payload, build_generate_payload
    from services.rollout.agent.constraints import output_constraint
    from services.rollout.agent.options import ResponseFormat, ToolChoice

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
    constraints = [{"json_schema": output_constraint(tools, ToolChoice("required"), ResponseFormat())},
                   {"json_schema": output_constraint(None, ToolChoice(), ResponseFormat("json_object"))},
                   {"regex": "(yes|no)"}, {"ebnf": 'root ::= "a" | "b"'}]
    payloads = [build_generate_payload(PROMPT, max_new_tokens=8, **c) for c in constraints]
    assert all(k in p["sampling_params"] for p, c in zip(payloads, constraints, strict=True) for k in c)
    return [{"method": "POST", "path": "/generate", "body": b} for b in [*payloads, build_batch_payload(payloads)]]


async def finish_rules(url: str) -> list[dict[str, Any]]:
    """What the CPU server does with `stop_token_ids`, with and without `ignore_eos`, as items for SGLang's
    own finish rule to judge (`Req._check_token_based_finish`: with ignore_eos no token ends the output)."""
    engine = InferenceEngine(InferenceClientSettings(servers=[url], max_retries=0))
    try:
        free = await engine.agenerate(ModelRequest(PROMPT, max_new_tokens=4, temperature=0.0, ignore_eos=True))
        stop_id = free.output_ids[0]
        items = []
        for ignore_eos in (False, True):
            res = await engine.agenerate(ModelRequest(PROMPT, max_new_tokens=4, temperature=0.0, ignore_eos=ignore_eos,
                                                      stop_token_ids=[stop_id]))
            items.append({"method": "POST", "path": "finish", "body": {
                "sampling_params": {"stop_token_ids": [stop_id], "ignore_eos": ignore_eos, "max_new_tokens": 4},
                "tokens": [stop_id], "eos": [2], "finished": res.stop_reason == "stop" and len(res.output_ids) == 1}})
        return items
    finally:
        await engine.aclose()


async def grammar_refusals(url: str) -> list[dict[str, Any]]:
    """What the CPU server started with `skip_tokenizer_init` answers to each kind of constraint, as
    items for SGLang's own grammar admission to judge: it has no grammar backend there and aborts the
    request with a 400 carrying its message."""
    items = []
    async with httpx.AsyncClient() as http:
        for params in ({"json_schema": '{"type": "object"}'}, {"regex": "[0-9]+"}, {"ebnf": 'root ::= "1"'}):
            reply = await http.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": {**params, "max_new_tokens": 4}})
            items.append({"method": "POST", "path": "grammar", "body": {
                "skip_tokenizer_init": True, "sampling_params": params, "refused": reply.text if reply.status_code == 400 else None}})
    return items


async def input_refusals(url: str, model: Path) -> list[dict[str, Any]]:
    """What the CPU server answers to bad input ids, as items for SGLang's own `_validate_one_request`:
    an input as long as the context, input + max_new_tokens over it, one that fits, and out-of-vocabulary
    ids (refused by the CPU server only, on purpose: SGLang checks no vocabulary and a GPU embedding
    fails on them; docs/inference.md "Bad input")."""
    items = []
    async with httpx.AsyncClient() as http:
        context = (await http.get(url + "/server_info")).json()["context_length"]
        cases = [([1] * context, 4, False), ([1] * (context // 2), context, False), (PROMPT, 4, False), ([1, 5, 10_000], 4, True)]
        for ids, max_new, stricter in cases:
            reply = await http.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}})
            assert reply.status_code in (200, 400), reply.text
            items.append({"method": "POST", "path": "validate", "body": {
                "model_path": str(model), "context_len": context, "input_ids": ids, "sampling_params": {"max_new_tokens": max_new},
                "refused": reply.text if reply.status_code == 400 else None, "stricter": stricter}})
    assert items[-1]["body"]["refused"] is not None  # the CPU server's own, stricter check
    return items


@dataclass
class App:
    version: str
    url: str


@pytest.fixture(scope="module", params=VERSIONS)
def app(request: pytest.FixtureRequest, server: ServerProcess, tiny_model: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    """SGLang's own HTTP app at each version the tier runs (one process per version, shared by its tests)."""
    version = str(request.param)
    with sglang_app(version, server.url, tiny_model, tmp_path_factory.mktemp(f"sglang-{version}") / "app.log") as url:
        yield App(version, url)


async def test_jetrl_clients_against_sglangs_own_http_app(app: App, tiny_model: Path, tmp_path: Path) -> None:
    from services.inference.make_model import build_model

    async with httpx.AsyncClient() as http:
        assert (await http.get(app.url + "/get_weight_version")).status_code == 404
        assert (await http.get(app.url + "/server_info")).json()["version"] == app.version
        refused = await http.post(app.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"stop": ["a"]}})
        assert refused.status_code == 400 and "skip_tokenizer_init" in refused.text  # what jetrl used to send
        # jetrl's constrained bodies pass SGLang's parsing and checks and reach the server as sent: this
        # one (skip_tokenizer_init, as SGLang's) has no grammar backend and answers with SGLang's own abort
        for payload in constrained_payloads():
            reply = await http.post(app.url + "/generate", json=payload["body"])
            assert reply.status_code == 400 and SGLANG_NO_BACKEND in reply.text, reply.text
    rec = await Recorder(app.url).start()
    try:
        await drive_clients(rec, tiny_model, build_model(tmp_path / "seed1", seed=1))
    finally:
        await rec.stop()
    # `/ready` is 404 where SGLang lacks it (before 0.5.20): the agent's readiness then polls `/health`.
    no_ready = "/ready" not in sglang_pkg.routes(app.version)
    refused = [(e.path, e.status, e.reply) for e in rec.exchanges if e.status != 200 and not (no_ready and e.path == "/ready")]
    assert not refused, refused
    assert rec.requests("/health") if no_ready else not rec.requests("/health")
    batches = [e.reply for e in rec.requests("/generate") if isinstance(e.reply, list)]
    assert [len(b) for b in batches] == [GROUP]  # the group went as one batched request, answered with a list
    generated = [g for e in rec.requests("/generate") for g in (e.reply if isinstance(e.reply, list) else [e.reply])]
    assert all("output_token_logprobs" in g["meta_info"] and "weight_versions" in g["meta_info"] for g in generated)


async def test_a_batch_through_sglangs_app_gives_each_sample_what_it_gets_alone(app: App) -> None:
    """The batched `/generate` the engine sends for a group, served by SGLang's own app: each sample is
    the one its request gets alone (same seeds), and a batch SGLang refuses for one bad input is sent
    again pass by pass, so only that sample fails."""
    rec = await Recorder(app.url).start()
    engine = InferenceEngine(InferenceClientSettings(servers=[rec.url], max_retries=0))
    try:
        reqs = [ModelRequest(PROMPT, max_new_tokens=5, ignore_eos=True, seed=40 + i) for i in range(GROUP)]
        batched = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
        alone = [await engine.agenerate(r) for r in reqs]
        for b, a in zip(batched, alone, strict=True):
            assert (b.output_ids, b.output_versions) == (a.output_ids, a.output_versions)
            assert b.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-4)
        sent = rec.requests("/generate")
        assert len(sent) == 1 + GROUP and isinstance(sent[0].reply, list) and len(sent[0].reply) == GROUP
        rec.exchanges.clear()
        reqs[2] = ModelRequest([1, 5, 10_000], max_new_tokens=5, ignore_eos=True, seed=2)  # out of vocabulary
        out = await asyncio.gather(*(engine.agenerate(r) for r in reqs), return_exceptions=True)
        assert isinstance(out[2], BadRequestError), out[2]
        assert all(len(r.output_ids) == 5 for i, r in enumerate(out) if i != 2 and not isinstance(r, BaseException))
        assert sum(isinstance(r, BaseException) for r in out) == 1
        statuses = [e.status for e in rec.requests("/generate")]
        assert statuses[0] == 400 and len(statuses) == 1 + GROUP  # SGLang refused the batch; each pass went alone
    finally:
        await engine.aclose()
        await rec.stop()


async def test_the_weights_agent_starts_and_loads_versions_against_sglangs_app(
    app: App, nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    """`jetrl weights` as shipped, as a process, beside SGLang's app: it starts (version check, readiness,
    weight version from /model_info) and loads two versions with `pause_mode=in_place` while generations
    run (whether the load lands inside one is timing; the held-in-place case is `drive_clients`')."""
    import nats

    from schemas.messages import WeightsLoaded, WeightsLoadFailed, decode
    from schemas.subjects import Subjects
    from services.weights.sender.publisher import WeightPublisher, ensure_weight_sync_stream
    from tests.support.weights import make_version

    nc = await nats.connect(nats_url)
    reports: asyncio.Queue[WeightsLoaded | WeightsLoadFailed] = asyncio.Queue()
    await ensure_weight_sync_stream(nc)
    subjects = Subjects("contract")

    async def on_loaded(msg: nats.aio.msg.Msg) -> None:
        await reports.put(decode(WeightsLoaded, msg.data))

    async def on_failed(msg: nats.aio.msg.Msg) -> None:
        await reports.put(decode(WeightsLoadFailed, msg.data))

    await nc.subscribe(subjects.weights_loaded_all, cb=on_loaded)
    await nc.subscribe("jetrl.contract.weights.failed.>", cb=on_failed)
    log = tmp_path / "agent.log"
    args = [sys.executable, "-m", "services.weights", f"server={app.url}", f"nats_url={nats_url}", "run=contract",
            f"cache_dir={tmp_path / 'cache'}", "pause_mode=in_place", "log_format=json"]
    engine = InferenceEngine(InferenceClientSettings(servers=[app.url]))
    with open(log, "wb") as out:
        agent = subprocess.Popen(args, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = await engine.get_weight_version(app.url)
        pub = WeightPublisher(nc, "contract", keep_last=2)
        for v in (base + 1, base + 2):
            task = asyncio.create_task(engine.agenerate(ModelRequest(PROMPT, max_new_tokens=300, ignore_eos=True)))
            await wait_running(app.url, task)
            await pub.publish_dir(v, v, make_version(tiny_model, tmp_path / f"c{v}", v))
            report = await asyncio.wait_for(reports.get(), 120)
            assert isinstance(report, WeightsLoaded) and report.version == v, f"{report!r}\n{log.read_text()[-3000:]}"
            res = await asyncio.wait_for(task, 120)  # finished, whether or not the load landed during it
            assert len(res.output_ids) == 300 and res.output_versions == sorted(res.output_versions)
            assert await engine.get_weight_version(app.url) == v
            after = await engine.agenerate(ModelRequest(PROMPT, max_new_tokens=4, ignore_eos=True))
            assert after.output_versions == [v] * 4
        assert agent.poll() is None, log.read_text()[-3000:]
    finally:
        agent.terminate()
        agent.wait(20)
        await engine.aclose()
        await nc.close()


def documented_routes() -> list[tuple[str, str, tuple[int, ...], tuple[int, ...] | None]]:
    """The route table of docs/sglang.md: (path, method, since, gone)."""
    rows = []
    for line in (sglang_pkg.ROOT / "docs" / "sglang.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("/"):
            since, gone = parse_server_version(cells[2]), parse_server_version(cells[3])
            assert since is not None, line
            rows.append((cells[0], cells[1], since, gone))
    return rows


@pytest.mark.parametrize("version", VERSIONS)
def test_the_documented_route_table_is_sglangs(version: str) -> None:
    rows = documented_routes()
    assert len(rows) >= 10
    v = parse_server_version(version)
    assert v is not None
    table = sglang_pkg.routes(version)
    for path, method, since, gone in rows:
        expected = since <= v and (gone is None or v < gone)
        assert (method in table.get(path, set())) == expected, f"docs/sglang.md: {path} {method} at SGLang {version}"


async def test_the_agent_proxys_stop_strings_through_sglangs_app(app: App, tiny_model: Path) -> None:
    """The agent proxy's generate path (OpenAI `stop`) on a `--skip-tokenizer-init` SGLang: applied by the
    engine, never sent (SGLang would refuse it with a 400)."""
    import openai
    from transformers import AutoTokenizer

    from services.rollout.agent.proxy import AgentProxy, SamplingDefaults
    from services.rollout.agent.server import ProxyServer

    engine = InferenceEngine(InferenceClientSettings(servers=[app.url]))
    srv = ProxyServer(AgentProxy(engine, AutoTokenizer.from_pretrained(tiny_model), SamplingDefaults(max_new_tokens=24)))
    await srv.start()
    try:
        async with httpx.AsyncClient() as http:
            async def ask(**kw: Any) -> str:
                sid = (await http.post(f"{srv.url}/rl/start_session", json={"task_id": "t"})).json()["session_id"]
                client = openai.AsyncOpenAI(base_url=srv.base_url(sid), api_key="x", http_client=http)
                resp = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "123="}],
                                                            temperature=0, **kw)
                return str(resp.choices[0].message.content or "")

            free = await ask()
            stop = free[4:6]
            assert len(stop) == 2, free
            cut = free.index(stop)
            stopped = await ask(stop=[stop])
            assert stopped in (free[:cut], free[: cut + len(stop)])  # trimmed (or not) by the proxy, never beyond
    finally:
        await srv.aclose()
        await engine.aclose()


async def test_a_colocated_update_goes_through_sglangs_own_route(app: App, server: ServerProcess, tiny_model: Path) -> None:
    """The trainer's colocated sender against SGLang's `/update_weights_from_tensor` (and, from 0.5.21,
    its session routes): SGLang parses the request, the CPU server behind it takes the tensors by
    shared-memory handle, bit for bit. The server's weights and version are put back after."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.weights.sender.colocated import ColocatedSender

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    original = {n: p.detach() for n, p in model.named_parameters()}
    state = {n: t + 0.5 for n, t in original.items()}
    name = "model.layers.0.mlp.down_proj.weight"
    async with httpx.AsyncClient(timeout=30) as http:
        before = (await http.get(f"{server.url}/model_info")).json()["weight_version"]
        sender = ColocatedSender([app.url], bucket_mb=0.05, timeout_s=60)
        try:
            result = await sender.send_version(77, state)
            assert result.loaded == [app.url], result.failed
            assert (await http.get(f"{app.url}{MODEL_INFO}")).json()["weight_version"] == "77"
            served = (await http.post(f"{server.url}/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30})).json()
            assert torch.equal(torch.tensor(served, dtype=torch.float32), state[name])
            assert (await sender.send_version(int(before), original)).loaded == [app.url]
        finally:
            await sender.aclose()
        assert (await http.get(f"{server.url}/model_info")).json()["weight_version"] == before
