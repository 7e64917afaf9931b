"""Errors the proxy answers with, shaped as the SDK on the other end expects them.

OpenAI endpoints: `{"error": {"message", "type", "param", "code"}}`; the Anthropic endpoint:
`{"type": "error", "error": {"type", "message"}}`. Both SDKs raise their typed `APIStatusError`
subclass (BadRequestError, NotFoundError, ...) with the message, so an agent sees what it got wrong.
"""

from __future__ import annotations

from typing import Any

_ANTHROPIC_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "invalid_request_error",
                    500: "api_error", 502: "api_error", 503: "overloaded_error", 504: "api_error"}


class ProxyError(Exception):
    """A request the proxy refuses (4xx) or could not serve (5xx)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        if self.status == 404:
            return "not_found_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code="invalid_request")


def not_found(message: str, code: str = "not_found") -> ProxyError:
    return ProxyError(404, message, code=code)
