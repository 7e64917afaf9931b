"""What `jetrl status` makes of a part the bus does not answer: the rest is still shown."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from nats.js.errors import NotFoundError

from services.common.busretry import retryable

T = TypeVar("T")


async def answered(what: str, call: Awaitable[T], unanswered: dict[str, str]) -> T | None:
    """`await call`; None when what it asks for does not exist, or when the bus gives no answer (a
    timeout, a 503, as while a cluster has lost its majority): then `unanswered[what]` holds the error.
    Any other error is raised."""
    try:
        return await call
    except NotFoundError:
        return None
    except Exception as exc:
        if not retryable(exc):
            raise
        unanswered[what] = repr(exc)
        return None
