"""The few SGLang control endpoints the agent calls on its one inference server.

The rollout client (`services/rollout/engine.py`) spreads generation over many servers with failover;
the agent talks to exactly one, must choose the pause mode, and must tell a refused load (400, the
server keeps its old weights) from an unreachable server, so it speaks the protocol directly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx


class ServerError(RuntimeError):
    """The server refused a call or could not be reached; the message says which and why."""


def parse_version(raw: object) -> int:
    """SGLang's `weight_version` is a string; its default "default" means the initial weights, 0."""
    if raw in (None, "", "default"):
        return 0
    return int(str(raw))


class ServerClient:
    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def wait_ready(self, timeout_s: float, stopping: asyncio.Event | None = None) -> bool:
        """Poll `/health` until 200; False if `stopping` was set first. Raises on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        last = "no answer yet"
        while asyncio.get_running_loop().time() < deadline:
            if stopping is not None and stopping.is_set():
                return False
            try:
                resp = await self._http.get("/health", timeout=5.0)
                if resp.status_code == 200:
                    return True
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            await asyncio.sleep(0.2)
        raise ServerError(f"{self.base_url} not healthy within {timeout_s}s ({last})")

    async def get_weight_version(self) -> int:
        body = await self._call("GET", "/get_weight_version")
        return parse_version(body.get("weight_version"))

    async def pause(self, mode: str) -> None:
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        body = await self._call(
            "POST", "/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version)}
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
