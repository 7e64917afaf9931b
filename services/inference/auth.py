"""API keys of the inference server, as SGLang's `--api-key` and `--admin-api-key` work
(sglang/srt/utils/auth.py, 0.5.x): a request shows a key as `Authorization: Bearer <key>`.

- Health and readiness (`/health*`, `/ready*`, `/metrics*`) are always open: probes carry no secret.
- Admin routes (weight updates, pause / continue, abort, cache flush, the distributed weight-update
  group; SGLang's ADMIN_OPTIONAL): with `admin_api_key` set they need it (`api_key` is not enough);
  else with `api_key` set they need that; with neither, they are open. Every route that is not a
  serving one (`services.common.trust.SERVING_ROUTES`) counts as admin, so a route added later is
  protected without being listed.
- Serving routes (generation, model and server info, `/v1/...`): need `api_key` when it is set.

A refused request gets 401 `{"error": "Unauthorized"}`, as from SGLang.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Awaitable, Callable

from aiohttp import web

from services.common.trust import OPEN_PREFIXES, is_admin_route


def allowed(method: str, path: str, authorization: str | None, api_key: str, admin_api_key: str) -> bool:
    """SGLang's decision for one request (`decide_request_auth`, without its ADMIN_FORCE routes)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    if is_admin_route(path):
        expected = admin_api_key or api_key
    else:
        expected = api_key
    return not expected or _bearer_is(authorization, expected)


def _bearer_is(authorization: str | None, expected: str) -> bool:
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), expected.encode())


def middleware(api_key: str, admin_api_key: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def check_key(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if not allowed(request.method, request.path, request.headers.get("Authorization"), api_key, admin_api_key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check_key


def is_loopback(host: str) -> bool:
    """Whether listening on `host` keeps the server to this machine (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface
