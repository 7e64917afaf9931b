"""The inference server's API keys, as SGLang's `--api-key` / `--admin-api-key`: a real CPU server
process. Admin routes refuse a request without the admin key (401), health stays open for probes,
the weights agent's client and the rollout engine get through with the keys from their settings,
and a server asked to listen beyond loopback without a key refuses to start, naming the setting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.common.nats_server import free_port
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import InferenceEngine, ModelRequest
from services.weights.agent.server_client import ServerClient, ServerError
from tests.support.weights import ROOT, make_version, process, wait_healthy

ADMIN = "admin-secret-1"
API = "api-secret-2"


@pytest.mark.timeout(120)
async def test_admin_routes_need_the_admin_key_and_clients_send_theirs(tmp_path: Path, tiny_model: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    (tmp_path / "admin.key").write_text(ADMIN + "\n")
    args = ["-m", "services.inference", f"model_path={tiny_model}", f"port={port}", f"admin_api_key_file={tmp_path / 'admin.key'}",
            f"api_key={API}"]
    with process(args, tmp_path / "s.log") as proc:
        await wait_healthy(url, proc, tmp_path / "s.log")  # /health is open: probes carry no key
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk", "/abort_request",
                         "/init_weights_update_group", "/update_weights_from_distributed"):
                for headers in ({}, {"Authorization": f"Bearer {API}"}, {"Authorization": "Bearer wrong"}):
                    resp = await http.post(path, json={}, headers=headers)
                    assert resp.status_code == 401, (path, headers, resp.text)
            assert (await http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})).status_code == 401
            assert (await http.get("/ready")).status_code == 200

        # the weights agent's client, with both keys (trust.inference_api_key / _admin_api_key): pause, load, resume
        client = ServerClient(url, 30.0, keys=(API, ADMIN))
        stranger = ServerClient(url, 30.0, keys=(API, ""))
        try:
            with pytest.raises(ServerError):
                await stranger.pause("abort")
            await client.pause("abort")
            await client.update_weights_from_disk(str(make_version(tiny_model, tmp_path / "v7", 7)), 7)
            await client.resume()
            assert await client.get_weight_version() == 7
        finally:
            await client.aclose()
            await stranger.aclose()

        # the rollout engine, with the server's api_key
        engine = InferenceEngine(InferenceClientSettings(servers=[url], max_retries=0), keys=(API, ""))
        try:
            resp = await engine.agenerate(ModelRequest(input_ids=[1, 5], max_new_tokens=4, ignore_eos=True))
            assert resp.output_versions == [7] * 4
        finally:
            await engine.aclose()
    assert ADMIN not in (tmp_path / "s.log").read_text()


def test_a_server_beyond_loopback_without_a_key_refuses_to_start(tmp_path: Path, tiny_model: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "services.inference", f"model_path={tiny_model}", "host=0.0.0.0",
                           f"port={free_port()}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "admin_api_key" in proc.stderr + proc.stdout and "0.0.0.0" in proc.stderr + proc.stdout
