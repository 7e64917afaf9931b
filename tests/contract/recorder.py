"""A recording reverse proxy: jetrl's clients talk to it, it forwards to the CPU server and keeps every
request body and JSON reply, so the contract tier can judge the real traffic with SGLang's models."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web


@dataclass
class Exchange:
    method: str
    path: str
    body: Any
    status: int
    reply: Any


@dataclass
class Recorder:
    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> Recorder:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self._session = aiohttp.ClientSession()
        return self

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _forward(self, request: web.Request) -> web.Response:
        assert self._session is not None
        raw = await request.read()
        async with self._session.request(request.method, self.upstream + request.path_qs, data=raw or None,
                                         headers={"Content-Type": request.content_type}) as resp:
            status, text, ctype = resp.status, await resp.text(), resp.content_type
        self.exchanges.append(Exchange(request.method, request.path, _json(raw.decode() if raw else ""), status, _json(text)))
        return web.Response(status=status, text=text, content_type=ctype)

    def requests(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.path == path]


def _json(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text
