"""The few SGLang control endpoints the agent calls on its one inference server.

The rollout client (`services/rollout/engine.py`) spreads generation over many servers with failover;
the agent talks to exactly one, must choose the pause mode, and must tell a refused load (400, the
server keeps its old weights) from an unreachable server, so it speaks the protocol directly.

At start (`wait_ready`) it reads the server's SGLang version and refuses one too old for jetrl.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from schemas.sglang_protocol import (
    MODEL_INFO,
    READY_POLL_TIMEOUT_S,
    ProtocolError,
    check_server_version,
    parse_server_version,
    readiness_urls,
)
from services.common.trust import InferenceAuth

__all__ = ["READY_POLL_TIMEOUT_S", "ServerClient", "ServerError", "readiness_urls"]

"""One readiness poll's timeout: SGLang's `/health` runs a test generation, which waits out a pause
(it answered 503 after 20 s while paused), so a short timeout would call a loading server dead."""


class ServerError(RuntimeError):
    """The server refused a call or could not be reached; the message says which and why."""


def parse_version(raw: object) -> int:
    """SGLang's `weight_version` is a string; its default "default" means the initial weights, 0."""
    if raw in (None, "", "default"):
        return 0
    return int(str(raw))


class ServerClient:
    def __init__(self, base_url: str, timeout_s: float, pause_mode: str = "abort", keys: tuple[str, str] = ("", "")) -> None:
        """keys: the server's (api_key, admin_api_key), each shown where the server wants it (`trust.inference_*`)."""
        self.base_url = base_url.rstrip("/")
        self.pause_mode = pause_mode
        """The mode the agent pauses with (every supported SGLang has all three)."""
        self.version: tuple[int, ...] | None = None
        """The server's SGLang version, read by `wait_ready` (None: it reports none)."""
        self._paused_mode: str | None = None
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, auth=InferenceAuth(*keys))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def wait_ready(self, timeout_s: float, stopping: asyncio.Event | None = None) -> bool:
        """Poll the server's readiness (`/ready` where SGLang has it, else `/health`) until 200, then read
        its version and refuse a server too old (ServerError naming the version and the missing
        feature). False if `stopping` was set first. Raises on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        last = "no answer yet"
        path = "/ready"
        while asyncio.get_running_loop().time() < deadline:
            if stopping is not None and stopping.is_set():
                return False
            try:
                resp = await self._http.get(path, timeout=READY_POLL_TIMEOUT_S)
                if resp.status_code == 404 and path == "/ready":
                    path = "/health"  # an SGLang without its readiness route
                    continue
                if resp.status_code == 200:
                    await self._check_version()
                    return True
                last = f"{path}: HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = f"{path}: {exc!r}"
            await asyncio.sleep(0.2)
        raise ServerError(f"{self.base_url} not ready within {timeout_s}s ({last})")

    async def _check_version(self) -> None:
        for path in ("/server_info", "/get_server_info"):  # /server_info is the newer name
            resp = await self._http.get(path)
            if resp.status_code == 200:
                self.version = parse_server_version(resp.json().get("version"))
                break
        try:
            check_server_version(self.base_url, self.version)
        except ProtocolError as exc:
            raise ServerError(str(exc)) from exc

    async def get_weight_version(self) -> int:
        """The version the server serves, from its model info (SGLang has no `/get_weight_version`)."""
        body = await self._call("GET", MODEL_INFO)
        return parse_version(body.get("weight_version"))

    async def pause(self, mode: str) -> None:
        await self._call("POST", "/pause_generation", {"mode": mode})
        self._paused_mode = mode

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", {})
        self._paused_mode = None

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Load a checkpoint. After an `in_place` or `retract` pause requests are still held by the
        server, and SGLang refuses its default cache flush then (400, after the weights and version have
        already changed), so the flush is asked for only when nothing can be running."""
        flush = self._paused_mode in (None, "abort")
        body = await self._call(
            "POST", "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": str(version), "flush_cache": flush},
        )
        if body.get("success") is False:
            raise ServerError(f"update_weights_from_disk refused: {body.get('message', body)}")

    async def _call(self, method: str, path: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            resp = await self._http.request(method, path, json=payload)
        except httpx.HTTPError as exc:
            raise ServerError(f"{method} {self.base_url}{path}: {exc!r}") from exc
        if resp.status_code != 200:
            raise ServerError(f"{method} {self.base_url}{path}: HTTP {resp.status_code}: {_message(resp)}")
        try:
            body = resp.json()
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:300]
