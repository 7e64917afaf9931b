"""`jetrl inference` over raw HTTP: SGLang's error shape, streaming, pause semantics (in-flight abort,
queued "Abort before prefill", new requests blocked), weight-update failures, info endpoints,
`simulate` mode and shutdown. One real server process with `max_batch_size=1` so a queue forms."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.inference import ServerProcess, running_servers, spawn_server, wait_ready

LONG = {"input_ids": [1, 5, 6, 13], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "return_logprob": True}


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_servers(tiny_model, tmp_path_factory.mktemp("inference-server"), 1, "max_batch_size=1") as (s,):
        yield s


@pytest.fixture
async def http(server: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        yield client


async def until(http: httpx.AsyncClient, key: str, value: int) -> None:
    for _ in range(2000):
        if (await http.get("/v1/loads")).json()["loads"][0][key] >= value:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"/v1/loads never reached {key} >= {value}")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"sampling_params": {"max_new_tokens": 2}}, "Either text or input_ids"),
        ({"input_ids": [1, 48]}, "out of vocabulary"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -2}}, "max_new_tokens"),
        ({"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 500}}, "context length"),
    ],
)
async def test_bad_input_gets_sglang_error_shape(http: httpx.AsyncClient, body: dict, needle: str) -> None:
    resp = await http.post("/generate", json=body)
    assert resp.status_code == 400 and needle in resp.json()["error"]["message"]


async def test_stream_sends_cumulative_chunks_then_done(http: httpx.AsyncClient) -> None:
    body = {"input_ids": [1, 5, 13], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}, "return_logprob": True}
    whole = (await http.post("/generate", json=body)).json()
    events = []
    async with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and len(chunks) > 1
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["text"] == whole["text"]


async def test_pause_aborts_in_flight_and_queued_and_blocks_new(http: httpx.AsyncClient) -> None:
    running = asyncio.create_task(http.post("/generate", json=LONG))
    await until(http, "num_running_reqs", 1)
    queued = asyncio.create_task(http.post("/generate", json=LONG))  # max_batch_size=1: it waits
    await until(http, "num_waiting_reqs", 1)
    assert (await http.post("/pause_generation", json={"mode": "abort"})).json()["status"] == "ok"

    partial = (await running).json()["meta_info"]
    assert partial["finish_reason"]["type"] == "abort" and 0 < partial["completion_tokens"] < 400
    assert len(partial["output_token_logprobs"]) == partial["completion_tokens"]
    before = (await queued).json()
    assert before["output_ids"] == [] and before["meta_info"]["finish_reason"]["message"] == "Abort before prefill"
    assert "output_token_logprobs" not in before["meta_info"] and before["meta_info"]["prompt_tokens"] == 0

    blocked = asyncio.create_task(http.post("/generate", json={"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 3}}))
    done, _ = await asyncio.wait([blocked], timeout=0.3)
    assert not done  # new requests wait while paused
    await http.post("/continue_generation")
    assert (await blocked).json()["meta_info"]["finish_reason"]["type"] in ("stop", "length")


async def test_abort_request_by_rid_returns_partial_output(http: httpx.AsyncClient) -> None:
    task = asyncio.create_task(http.post("/generate", json={**LONG, "rid": "to-abort"}))
    await until(http, "num_running_reqs", 1)
    assert (await http.post("/abort_request", json={"rid": "to-abort"})).status_code == 200
    meta = (await task).json()["meta_info"]
    assert meta["id"] == "to-abort" and meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 400


async def test_bad_weight_updates_are_400_and_old_weights_keep_serving(http: httpx.AsyncClient, tmp_path: Path) -> None:
    from services.inference.make_model import build_model

    greedy = {"input_ids": [1, 5, 6, 13], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    before = (await http.post("/generate", json=greedy)).json()["output_ids"]
    version = (await http.get("/model_info")).json()["weight_version"]

    missing = await http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope"), "weight_version": "9"})
    assert missing.status_code == 400 and not missing.json()["success"] and "does not exist" in missing.json()["message"]
    wrong = build_model(tmp_path / "narrow", hidden=32)
    shape = await http.post("/update_weights_from_disk", json={"model_path": str(wrong), "weight_version": "9"})
    assert shape.status_code == 400 and "shape mismatch" in shape.json()["message"]

    assert (await http.get("/model_info")).json()["weight_version"] == version
    assert (await http.post("/generate", json=greedy)).json()["output_ids"] == before


async def test_info_endpoints(http: httpx.AsyncClient, tiny_model: Path) -> None:
    assert (await http.get("/health")).status_code == 200 and (await http.get("/ready")).status_code == 200
    assert (await http.get("/get_weight_version")).status_code == 404  # SGLang has no such route
    assert (await http.get("/get_load")).status_code == 404
    assert (await http.get("/get_model_info")).json() == (await http.get("/model_info")).json()
    info = (await http.get("/model_info")).json()
    assert info["model_path"] == str(tiny_model) and info["is_generation"] is True and "weight_version" in info
    models = (await http.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 512
    server = (await http.get("/server_info")).json()
    assert server["vocab_size"] == 48 and server["max_batch_size"] == 1 and server["version"] == "0.5.23"
    assert (await http.get("/v1/loads")).json()["loads"][0]["num_running_reqs"] == 0
    assert (await http.post("/flush_cache")).status_code == 200


async def test_simulate_mode_serves_long_tailed_random_completions_and_drains_on_sigterm(tmp_path: Path) -> None:
    proc = spawn_server(None, tmp_path, "simulate=true", "sim.token_latency_s=0.001", "sim.median_new_tokens=8", "sim.length_sigma=1.0")
    try:
        wait_ready(proc)
        async with httpx.AsyncClient(base_url=proc.url, timeout=60) as http:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 200}, "return_logprob": True}
            outs = await asyncio.gather(*(http.post("/generate", json=body) for _ in range(24)))
            metas = [o.json()["meta_info"] for o in outs]
            lengths = [m["completion_tokens"] for m in metas]
            assert len(set(lengths)) > 3 and max(lengths) > 2 * sorted(lengths)[len(lengths) // 2]  # a long tail
            assert all(m["finish_reason"]["type"] in ("stop", "length") for m in metas)
            assert all(len(m["output_token_logprobs"]) == m["completion_tokens"] for m in metas)
        assert proc.stop(signal.SIGTERM) == 0
    finally:
        proc.stop(signal.SIGKILL, timeout=5)
