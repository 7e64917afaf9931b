"""The HTTP side port every service gets when its `health_port` setting is set (containers, k8s probes).

- `GET /healthz`: 200 while the service's event loop answers (liveness).
- `GET /readyz`: 200 when every registered readiness check passes (NATS connected, upstreams
  reachable), else 503; the JSON body names each check and its state.
- `GET /metrics`: Prometheus text. Every value a `MetricsPublisher` emits is mirrored here as a gauge
  `jetrl_<key>{service, worker}`, so a service gets Prometheus metrics without writing any.

Checks live in a process-wide registry (`register_check`) so that code deep inside a service (for
example `services.common.bus.connect`) can declare what "ready" means without knowing the server.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Gauge, generate_latest

from services.common.logging import get_logger

log = get_logger("health")

# A check answers True (ready), False (not ready), or raises (not ready, the error is the reason).
# Returning None means "this check no longer applies" (its object is gone) and removes it.
Check = Callable[[], bool | Awaitable[bool | None] | None]

_checks: dict[str, Check] = {}
_lock = threading.Lock()
CHECK_TIMEOUT_S = 2.0
"""A check slower than this counts as failed: a probe must answer quickly."""


def register_check(name: str, check: Check) -> None:
    """Add (or replace) the readiness check `name`."""
    with _lock:
        _checks[name] = check


def unregister_check(name: str) -> None:
    with _lock:
        _checks.pop(name, None)


def registered_checks() -> list[str]:
    with _lock:
        return sorted(_checks)


async def evaluate_checks() -> dict[str, dict[str, Any]]:
    """{name: {"ok": bool, "error": str (when not ok)}} for every registered check."""
    with _lock:
        items = list(_checks.items())
    results: dict[str, dict[str, Any]] = {}
    for name, check in items:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, CHECK_TIMEOUT_S)
        except Exception as exc:  # a failing check is a "not ready" answer, not a server error
            results[name] = {"ok": False, "error": repr(exc)}
            continue
        if value is None:
            unregister_check(name)
            continue
        results[name] = {"ok": bool(value)} if value else {"ok": False, "error": "check returned false"}
    return results


def http_check(*urls: str, timeout_s: float = 1.5) -> Check:
    """A check that passes when any of `urls` answers 2xx (one healthy upstream is enough: clients fail
    over between servers)."""

    async def check() -> bool:
        import httpx

        errors = []
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            for url in urls:
                try:
                    if (await client.get(url)).is_success:
                        return True
                    errors.append(f"{url}: not ready")
                except httpx.HTTPError as exc:
                    errors.append(f"{url}: {exc!r}")
        raise ConnectionError("; ".join(errors))

    return check


def nats_responder_check(nc: Any, subject: str, timeout_s: float = 1.0) -> Check:
    """A check that passes when a NATS service answers a request on `subject` (e.g. a micro-service
    `$SRV.PING.<name>`): someone is listening."""

    async def check() -> bool:
        await nc.request(subject, b"", timeout=timeout_s)
        return True

    return check


# ---- Prometheus mirror of MetricsPublisher events ---------------------------------------------

_gauges: dict[tuple[int, str], Gauge | None] = {}
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(key: str) -> str:
    """"reward/mean" -> "jetrl_reward_mean": Prometheus names allow only [a-zA-Z0-9_:]."""
    return "jetrl_" + _NAME_BAD.sub("_", key).strip("_").lower()


def mirror_metrics(service: str, worker: str, values: dict[str, float], registry: CollectorRegistry = REGISTRY) -> None:
    """Set gauge `jetrl_<key>{service, worker}` to each value. Never raises: metrics must not take
    a service down (a key whose name collides with another metric is skipped, once logged)."""
    for key, value in values.items():
        name = metric_name(key)
        with _lock:
            gauge = _gauges.get((id(registry), name), ...)
            if gauge is ...:
                try:
                    gauge = Gauge(name, f"jetrl metric {key!r} (last emitted value)", ["service", "worker"], registry=registry)
                except ValueError as exc:  # duplicate timeseries: another metric owns the name
                    log.warning("metric not mirrored to Prometheus", key=key, error=str(exc))
                    gauge = None
                _gauges[(id(registry), name)] = gauge
        if gauge is not None:
            gauge.labels(service=service, worker=worker).set(float(value))


# ---- the server -------------------------------------------------------------------------------


class HealthServer:
    """aiohttp server for /healthz, /readyz and /metrics on `host:port` (port 0 picks a free one)."""

    def __init__(self, port: int, host: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY) -> None:
        self.host = host
        self.port = port
        self.registry = registry
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            self.port = server.sockets[0].getsockname()[1]
        log.info("health side port listening", host=self.host, port=self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def _readyz(self, request: web.Request) -> web.Response:
        checks = await evaluate_checks()
        # No check registered: the service has nothing to wait for (e.g. the inference server, whose
        # own /health is the truth). Services register theirs before they start connecting.
        ready = all(c["ok"] for c in checks.values())
        return web.json_response({"ready": ready, "checks": checks}, status=200 if ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def run_with_health(port: int, coro: Awaitable[None], host: str = "127.0.0.1") -> None:
    """Serve the side port on `host:port` (port 0 = no side port) while `coro` runs."""
    if not port:
        await coro
        return
    server = HealthServer(port, host)
    await server.start()
    try:
        await coro
    finally:
        await server.stop()
