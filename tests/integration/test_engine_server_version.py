"""The rollout client reads a server's SGLang version once, but not from a server still loading: a
503 from `/server_info` is asked again, so a server too old for jetrl is still refused once it
answers. (Before, the 503 was remembered as "a router, no version" and the check never ran.)"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from services.common.ports import free_port
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import InferenceError, SGLangClient


@pytest.fixture
async def loading_then_old() -> AsyncIterator[tuple[str, list[str]]]:
    """A server whose `/server_info` is 503 (loading) at first, then SGLang 0.5.10's answer."""
    asked: list[str] = []

    async def server_info(request: web.Request) -> web.Response:
        asked.append(request.path)
        if len(asked) == 1:
            return web.json_response({"error": "loading"}, status=503)
        return web.json_response({"version": "0.5.10"})

    async def absent(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", absent)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", asked
    finally:
        await runner.cleanup()


async def test_a_loading_server_is_asked_again_and_an_old_one_refused(loading_then_old: tuple[str, list[str]]) -> None:
    url, asked = loading_then_old
    engine = SGLangClient(InferenceClientSettings(servers=[url]))
    try:
        assert await engine.connect(url) is None  # loading: no version yet, nothing refused
        with pytest.raises(InferenceError, match=r"SGLang 0\.5\.10"):
            await engine.connect(url)
        assert asked[:3] == ["/server_info", "/get_server_info", "/server_info"]
    finally:
        await engine.aclose()
