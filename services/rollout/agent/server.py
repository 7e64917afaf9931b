"""The proxy's HTTP face (aiohttp), run inside each rollout worker's event loop.

    POST /rl/start_session                      {"task_id"?}            -> {"session_id"}
    POST /{session}/v1/chat/completions         OpenAI Chat Completions -> ChatCompletion
    POST /{session}/v1/responses                OpenAI Responses        -> Response
    GET  /{session}/v1/responses/{id}           a stored Response, again
    POST /{session}/v1/completions              OpenAI Completions (legacy, text) -> text_completion
    POST /{session}/v1/embeddings               501: a generation policy serves no embeddings
    POST /{session}/v1/messages                 Anthropic Messages      -> Message
    POST /{session}/v1/messages/count_tokens    Anthropic Messages      -> {"input_tokens"}
    GET  /{session}/v1/models                   the served model, for SDKs that list models
    POST /{session}/rl/set_reward               {"reward"} (last completion) | {"interaction_id", "reward"}
    POST /{session}/rl/end_session              -> {"session_id", "interactions"}
    POST /export_trajectories                   {"session_id", "discount"=1.0, "style"="individual"}
                                                -> {"session_id", "style", "interactions": {id: sample}}
    GET  /health                                -> {"status": "ok", "sessions": n}

An agent only changes its `base_url` to `http://host:port/{session}/v1` (Anthropic SDK:
`http://host:port/{session}`). `stream: true` answers server-sent events (`streaming`). Errors
are OpenAI-shaped (`{"error": {...}}`), Anthropic-shaped on `/v1/messages`, with 404 for an unknown session,
400 for a malformed body, 409 after end_session, 422 for a completion that missed its tool_choice or
response_format (`options`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web

from services.common.logging import get_logger
from services.rollout.agent import replies, streaming
from services.rollout.agent.completions import completion, completion_events, parse_completions
from services.rollout.agent.errors import ProxyError, bad_request
from services.rollout.agent.proxy import AgentProxy
from services.rollout.agent.requests import SERVED_MODEL, parse_anthropic, parse_chat, parse_responses
from services.rollout.agent.streaming import Event

log = get_logger("rollout.agent")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _is_anthropic(request: web.Request) -> bool:
    return "/v1/messages" in request.path


def _error(request: web.Request, exc: ProxyError) -> web.Response:
    body = exc.anthropic_body() if _is_anthropic(request) else exc.openai_body()
    return web.json_response(body, status=exc.status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProxyError as exc:
        if exc.status >= 500:
            log.warning("proxy request failed", path=request.path, status=exc.status, error=exc.message)
        return _error(request, exc)
    except web.HTTPException as exc:  # unknown route or method: still an API-shaped error
        if exc.status < 400:
            raise
        return _error(request, ProxyError(exc.status, f"{request.method} {request.path}: {exc.reason}", code="unknown_route"))


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


class ProxyServer:
    def __init__(self, proxy: AgentProxy, host: str = "127.0.0.1", port: int = 0) -> None:
        self.proxy = proxy
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=64 * 1024**2)
        r = app.router
        r.add_get("/health", self.health)
        r.add_post("/rl/start_session", self.start_session)
        r.add_post("/export_trajectories", self.export)
        r.add_post("/{session}/v1/chat/completions", self.chat)
        r.add_post("/{session}/v1/responses", self.responses)
        r.add_get("/{session}/v1/responses/{response_id}", self.retrieve_response)
        r.add_post("/{session}/v1/completions", self.completions)
        r.add_post("/{session}/v1/embeddings", self.embeddings)
        r.add_post("/{session}/v1/messages", self.messages)
        r.add_post("/{session}/v1/messages/count_tokens", self.count_tokens)
        r.add_get("/{session}/v1/models", self.models)
        # the OpenAI routes at the session's root too: one base_url (`{url}/{session}`) then serves
        # both SDKs, as AReaL's gateway does (OpenAI appends `/chat/completions`, Anthropic `/v1/messages`)
        r.add_post("/{session}/chat/completions", self.chat)
        r.add_post("/{session}/responses", self.responses)
        r.add_get("/{session}/responses/{response_id}", self.retrieve_response)
        r.add_post("/{session}/completions", self.completions)
        r.add_get("/{session}/models", self.models)
        r.add_post("/{session}/rl/set_reward", self.set_reward)
        r.add_post("/{session}/rl/end_session", self.end_session)
        return app

    async def start(self) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # the port 0 picked
        log.info("agent proxy listening", url=self.url)
        return self.url

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, session_id: str) -> str:
        """What an OpenAI client's `base_url` is for this session."""
        return f"{self.url}/{session_id}/v1"

    def session_url(self, session_id: str) -> str:
        """The `base_url` an agent gets: the session's root, which serves the OpenAI routes and
        Anthropic's `/v1/messages` alike (an Anthropic client given `/v1` would post `/v1/v1/messages`)."""
        return f"{self.url}/{session_id}"

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- handlers ------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.proxy.sessions)})

    async def start_session(self, request: web.Request) -> web.Response:
        body = await _body(request) if request.can_read_body else {}
        task_id = body.get("task_id")
        session = self.proxy.start_session(None if task_id is None else str(task_id))
        return web.json_response({"session_id": session.id, "base_url": self.base_url(session.id)})

    async def _answer(self, request: web.Request, body: Any, events: Iterator[Event] | None) -> web.StreamResponse:
        """The JSON answer, or with `stream: true` its server-sent events."""
        if events is None:
            return web.json_response(body)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        for event in events:
            await out.write(streaming.encode(event))
        await out.write_eof()
        return out

    async def chat(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_chat(await _body(request))
        items = await self.proxy.complete_n(request.match_info["session"], parsed, "chat")
        chat = self.proxy.chat
        if parsed.stream:
            return await self._answer(request, None, streaming.chat_events(items, parsed, chat))
        return await self._answer(request, replies.chat_completion(items, parsed, chat), None)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_responses(await _body(request))
        item = await self.proxy.complete(request.match_info["session"], parsed, "responses")
        if parsed.store:
            self.proxy.session(request.match_info["session"]).stored[item.id] = parsed
        chat = self.proxy.chat
        if parsed.stream:
            return await self._answer(request, None, streaming.responses_events(item, parsed, chat))
        return await self._answer(request, replies.response(item, parsed, chat), None)

    async def retrieve_response(self, request: web.Request) -> web.Response:
        """`responses.retrieve(id)`: a stored response of this session, answered again."""
        session = self.proxy.session(request.match_info["session"])
        rid = request.match_info["response_id"]
        item, parsed = session.cache.get(rid), session.stored.get(rid)
        if item is None or parsed is None:
            raise ProxyError(404, f"no stored response {rid!r} in this session", code="response_not_found")
        return web.json_response(replies.response(item, parsed, self.proxy.chat))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_completions(await _body(request))
        items = await self.proxy.complete_n(request.match_info["session"], parsed, "completions")
        if not parsed.stream:
            return web.json_response(completion(items))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        for chunk in completion_events(items):
            await out.write(chunk)
        await out.write_eof()
        return out

    async def embeddings(self, request: web.Request) -> web.Response:
        raise ProxyError(501, "embeddings are not served: the proxy fronts a generation policy (SGLang /generate), which "
                              "returns no embeddings; use an embedding model of your own", code="not_implemented")

    async def messages(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_anthropic(await _body(request))
        item = await self.proxy.complete(request.match_info["session"], parsed, "messages")
        if parsed.stream:
            return await self._answer(request, None, streaming.anthropic_events(item, parsed, self.proxy.chat))
        return await self._answer(request, replies.anthropic_message(item, parsed), None)

    async def count_tokens(self, request: web.Request) -> web.Response:
        body = await _body(request)
        count = self.proxy.count_tokens(request.match_info["session"], parse_anthropic(body))
        return web.json_response({"input_tokens": count})

    async def models(self, request: web.Request) -> web.Response:
        self.proxy.session(request.match_info["session"])
        return web.json_response({"object": "list", "data": [{"id": SERVED_MODEL, "object": "model", "created": 0, "owned_by": "jetrl"}]})

    async def set_reward(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if "reward" not in body:
            raise bad_request('the body needs "reward" (and optionally "interaction_id")', "reward")
        interaction_id = body.get("interaction_id")
        item = self.proxy.set_reward(request.match_info["session"], body["reward"], None if interaction_id is None else str(interaction_id))
        return web.json_response({"interaction_id": item.id, "reward": item.reward})

    async def end_session(self, request: web.Request) -> web.Response:
        session = self.proxy.end_session(request.match_info["session"])
        return web.json_response({"session_id": session.id, "interactions": len(session.cache)})

    async def export(self, request: web.Request) -> web.Response:
        body = await _body(request)
        session_id = body.get("session_id")
        if not isinstance(session_id, str):
            raise bad_request('the body needs "session_id"', "session_id")
        discount = body.get("discount", 1.0)
        if isinstance(discount, bool) or not isinstance(discount, (int, float)):
            raise bad_request(f"discount must be a number, got {discount!r}", "discount")
        style = body.get("style", "individual")
        samples = self.proxy.export(session_id, float(discount), str(style))
        return web.json_response(
            {"session_id": session_id, "style": style, "interactions": {k: s.as_json() for k, s in samples.items()}}
        )
