"""Weight sync end to end: a real nats-server, real CPU inference servers (`python -m
services.inference`) and real agents (`python -m services.weights`), as separate processes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import pytest

from schemas.messages import WeightFile, WeightsLoaded, WeightsLoadFailed, WeightsPublished, decode, encode
from schemas.subjects import WEIGHT_SYNC_STREAM, WEIGHTS_BUCKET, Subjects
from services.common.busretry import RetryPolicy
from services.common.ports import free_port
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import ModelRequest, SGLangClient
from services.status.weights import weights_status
from services.weights import objstore
from services.weights.files import object_uri
from services.weights.sender.publisher import WeightPublisher, ensure_weight_sync_stream, latest_published
from tests.support.weights import TIMEOUT_S, Stack, make_version, process, server_version, wait_healthy


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[nats.aio.client.Client]:
    conn = await nats.connect(nats_url)
    await ensure_weight_sync_stream(conn)
    try:
        yield conn
    finally:
        await conn.close()


async def test_servers_follow_versions_keep_generating_refuse_corruption_and_late_agent_catches_up(
    nats_url: str, nc: nats.aio.client.Client, tmp_path: Path, tiny_model: Path
) -> None:
    # One scenario, so the two inference servers (torch start-up) are paid for once.
    stack = Stack(nats_url, "wsync", tmp_path, tiny_model)
    await stack.watch(nc)
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    pub = WeightPublisher(nc, "wsync", keep_last=2)
    with (
        process(stack.server_args(ports[0]), tmp_path / "s0.log") as s0,
        process(stack.server_args(ports[1]), tmp_path / "s1.log") as s1,
        process(stack.agent_args(urls[0], 0), tmp_path / "a0.log"),
    ):
        await asyncio.gather(wait_healthy(urls[0], s0, tmp_path / "s0.log"), wait_healthy(urls[1], s1, tmp_path / "s1.log"))

        # v1, v2, v3 reach server 0 in turn; server 1 has no agent yet and stays on its initial weights.
        for v in (1, 2, 3):
            await pub.publish_dir(v, v, make_version(tiny_model, tmp_path / f"c{v}", v))
            [loaded] = await stack.expect(WeightsLoaded, v, 1)
            assert loaded.server == urls[0]
        assert [await server_version(u) for u in urls] == ["3", "0"]
        assert sorted(p.name for p in (tmp_path / "cache0").iterdir()) == ["v3"]  # keep_local=1

        # An agent started after v3 was published loads v3 at once (and no older version).
        with process(stack.agent_args(urls[1], 1), tmp_path / "a1.log"):
            [late] = await stack.expect(WeightsLoaded, 3, 1)
            assert late.server == urls[1]
            assert [await server_version(u) for u in urls] == ["3", "3"]
            status = await weights_status(nc, "wsync")
            assert status.published_version == 3
            assert {(s.server, s.loaded_version, s.lag) for s in status.servers} == {(u, 3, 0) for u in urls}

            # A generation in flight across the v4 update finishes as one completion with both versions.
            engine = SGLangClient(InferenceClientSettings(servers=[urls[0]]))
            try:
                gen = asyncio.create_task(
                    engine.agenerate(ModelRequest(input_ids=[1, 5, 6, 7], max_new_tokens=480, ignore_eos=True, seed=1))
                )
                await wait_generating(urls[0])
                await pub.publish_dir(4, 4, make_version(tiny_model, tmp_path / "c4", 4))
                await stack.expect(WeightsLoaded, 4, 2)
                resp = await asyncio.wait_for(gen, TIMEOUT_S)
                assert resp.stop_reason == "length" and len(resp.output_ids) == 480
                assert resp.output_versions[0] == 3 and resp.output_versions[-1] == 4
                assert resp.output_versions == sorted(resp.output_versions)

                # v5 whose stored bytes do not match the announced sha256: refused by both agents; the
                # servers keep serving v4 and keep generating.
                await publish_corrupted(nc, "wsync", 5, make_version(tiny_model, tmp_path / "c5", 5))
                failed = await stack.expect(WeightsLoadFailed, 5, 2)
                assert all("sha256" in r.reason for r in failed), [r.reason for r in failed]
                assert [await server_version(u) for u in urls] == ["4", "4"]
                after = await asyncio.wait_for(
                    engine.agenerate(ModelRequest(input_ids=[1, 5], max_new_tokens=8, ignore_eos=True)), TIMEOUT_S
                )
                assert after.output_versions == [4] * 8
                status = await weights_status(nc, "wsync")
                assert all(s.loaded_version == 4 and s.failed_version == 5 and s.lag == 1 for s in status.servers)

                # The next announcement is tried afresh; this one through a shared directory.
                shared = WeightPublisher(nc, "wsync", shared_dir=tmp_path / "shared", keep_last=2)
                await shared.publish_dir(6, 6, make_version(tiny_model, tmp_path / "c6", 6))
                await stack.expect(WeightsLoaded, 6, 2)
                assert [await server_version(u) for u in urls] == ["6", "6"]
            finally:
                await engine.aclose()


async def wait_generating(url: str) -> None:
    """Until the server reports a running request (its /v1/loads), so the update lands mid-generation."""
    async with httpx.AsyncClient() as http:
        for _ in range(400):
            load = (await http.get(f"{url}/v1/loads")).json()["loads"]
            if _running(load) > 0:
                return
            await asyncio.sleep(0.01)
    raise TimeoutError(f"{url} never reported a running request")


def _running(load: object) -> int:
    items = load if isinstance(load, list) else [load]
    return sum(int(i.get("num_running_reqs", i.get("running", 0)) or 0) for i in items if isinstance(i, dict))


async def publish_corrupted(nc: nats.aio.client.Client, run: str, version: int, ckpt: Path) -> None:
    """Upload `ckpt` as `version`, then overwrite its weights object with flipped bytes, and announce
    the checksums of the good files: what a corrupted store or transfer looks like to an agent."""
    js = nc.jetstream()
    prefix = f"{run}/v{version}"
    files = []
    for name in ("config.json", "model.safetensors"):
        info = await objstore.put_file(js, WEIGHTS_BUCKET, f"{prefix}/{name}", ckpt / name, policy=RetryPolicy())
        files.append(WeightFile(name=name, sha256=objstore.digest_hex(info), size=int(info.size or 0)))
    bad = bytearray((ckpt / "model.safetensors").read_bytes())
    bad[-10] ^= 0xFF
    (ckpt / "bad.bin").write_bytes(bytes(bad))
    await objstore.put_file(js, WEIGHTS_BUCKET, f"{prefix}/model.safetensors", ckpt / "bad.bin", policy=RetryPolicy())
    last = await latest_published(nc, run)  # announced as the trainer would: under its epoch
    msg = WeightsPublished(run=run, version=version, uri=object_uri(WEIGHTS_BUCKET, prefix), files=files, step=version,
                           epoch=last.epoch if last else 0)
    await js.publish(Subjects(run).weights_published, encode(msg))


async def test_reports_survive_a_nats_server_restart_and_a_lost_one_never_stops_the_agent(tmp_path: Path) -> None:
    # The agent's side of a nats-server restart, without inference servers: its report is published
    # while the server is down, retried, and recorded once the server is back on the same store.
    from services.bus.nats_server import NatsServer
    from services.common.bus import connect
    from services.common.metrics import MetricsPublisher
    from services.weights.agent.agent import WeightsAgent
    from services.weights.agent.server_client import ServerClient
    from services.weights.settings import WeightsSettings

    server = NatsServer(tmp_path / "nats", port=free_port()).start()
    settings = WeightsSettings(run="wrestart", server="http://127.0.0.1:9", report_retry_s=60)
    subject = Subjects("wrestart").weights_loaded(settings.server_name)
    conn = await connect(server.url, "agent-under-test")  # reconnects forever, as the agent's does
    http = ServerClient(settings.server, 1.0)
    try:
        await ensure_weight_sync_stream(conn)
        agent = WeightsAgent(conn, http, settings, MetricsPublisher(conn, "wrestart", "weights", "s0"))
        server.stop()
        report = WeightsLoaded(run="wrestart", server=settings.server_name, version=7, seconds=1.5)
        pending = asyncio.create_task(agent.report(subject, report))
        while agent.metrics.counters["report_retries"] < 1:  # an attempt failed while the server was down
            assert not pending.done(), "the report gave up (or raised) while the server was down"
            await asyncio.sleep(0.05)
        server.start()  # the same port and store: the restart the agent must ride out
        assert await asyncio.wait_for(pending, 60) is True
        stored = await conn.jetstream().get_last_msg(WEIGHT_SYNC_STREAM, subject)
        assert decode(WeightsLoaded, stored.data) == report  # what `jetrl status` and the trainer read
        assert agent.metrics.counters["report_failures"] == 0

        # down for longer than report_retry_s: given up, logged and counted - never raised
        server.stop()
        brief = WeightsAgent(conn, http, settings.model_copy(update={"report_retry_s": 1.0}), agent.metrics)
        failed = WeightsLoadFailed(run="wrestart", server=settings.server_name, version=8, reason="x")
        assert await asyncio.wait_for(brief.report(Subjects("wrestart").weights_failed(settings.server_name), failed), 15) is False
        assert agent.metrics.counters["report_failures"] == 1
    finally:
        await http.aclose()
        with contextlib.suppress(ConnectionResetError):  # nats-py's close can raise while it reconnects
            await conn.close()
        server.stop()
