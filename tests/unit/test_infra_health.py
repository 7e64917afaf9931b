"""The side port (services/common/health.py): liveness, readiness from registered checks, Prometheus
text mirrored from MetricsPublisher values."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.common import health
from services.common.health import HealthServer, metric_name, mirror_metrics, register_check, unregister_check


@pytest.fixture
async def side_port() -> AsyncIterator[str]:
    for name in health.registered_checks():
        unregister_check(name)
    server = HealthServer(0, host="127.0.0.1")
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.stop()
        for name in health.registered_checks():
            unregister_check(name)


async def test_healthz_answers_and_readyz_follows_checks(side_port: str) -> None:
    state = {"up": False}
    register_check("nats:test", lambda: state["up"])

    async def upstream() -> bool:
        return True

    register_check("inference reachable", upstream)
    async with httpx.AsyncClient(base_url=side_port) as client:
        assert (await client.get("/healthz")).status_code == 200
        resp = await client.get("/readyz")
        assert resp.status_code == 503
        body = resp.json()
        assert body["ready"] is False
        assert body["checks"]["nats:test"]["ok"] is False
        assert body["checks"]["inference reachable"] == {"ok": True}
        state["up"] = True
        resp = await client.get("/readyz")
        assert resp.status_code == 200 and resp.json()["ready"] is True


async def test_a_raising_or_slow_check_is_not_ready_and_names_the_error(side_port: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise ConnectionRefusedError("reward service: no responders")

    async def hangs() -> bool:
        await asyncio.Event().wait()
        return True

    monkeypatch.setattr(health, "CHECK_TIMEOUT_S", 0.1)
    register_check("reward reachable", broken)
    register_check("slow", hangs)
    async with httpx.AsyncClient(base_url=side_port) as client:
        resp = await client.get("/readyz")
    assert resp.status_code == 503
    checks = resp.json()["checks"]
    assert "no responders" in checks["reward reachable"]["error"]
    assert checks["slow"]["ok"] is False


async def test_a_check_that_no_longer_applies_removes_itself(side_port: str) -> None:
    register_check("gone", lambda: None)
    register_check("failing", lambda: False)
    async with httpx.AsyncClient(base_url=side_port) as client:
        assert (await client.get("/readyz")).status_code == 503
        unregister_check("failing")
        resp = await client.get("/readyz")
    assert resp.status_code == 200
    assert "gone" not in resp.json()["checks"]
    assert "gone" not in health.registered_checks()


async def test_metrics_mirrors_emitted_values_as_labelled_gauges() -> None:
    registry = CollectorRegistry()
    server = HealthServer(0, host="127.0.0.1", registry=registry)
    await server.start()
    try:
        mirror_metrics("rollout", "rollout-1", {"reward/mean": 0.25, "episodes_per_s": 3.0}, registry=registry)
        mirror_metrics("rollout", "rollout-1", {"reward/mean": 0.75}, registry=registry)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            resp = await client.get("/metrics")
    finally:
        await server.stop()
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    lines = resp.text.splitlines()
    assert 'jetrl_reward_mean{service="rollout",worker="rollout-1"} 0.75' in lines
    assert 'jetrl_episodes_per_s{service="rollout",worker="rollout-1"} 3.0' in lines


def test_metric_names_are_valid_prometheus_names() -> None:
    assert metric_name("time/wait-fraction") == "jetrl_time_wait_fraction"
    assert metric_name("Reward Mean") == "jetrl_reward_mean"


async def test_http_check_passes_when_any_upstream_answers(side_port: str) -> None:
    from services.common.health import http_check
    from services.common.ports import free_port

    dead = f"http://127.0.0.1:{free_port()}/health"
    assert await http_check(dead, f"{side_port}/healthz")() is True
    with pytest.raises(ConnectionError, match=r"127\.0\.0\.1"):
        await http_check(dead)()
