"""NATS connection with reconnect, and idempotent declaration of the streams of DESIGN.md."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Iterable

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from schemas.subjects import StreamSpec, stream_specs
from services.common.health import register_check, unregister_check
from services.common.logging import get_logger

log = get_logger("bus")

# Replies to requests larger than this go over several messages; keep a margin below max_payload.
DEFAULT_PENDING_BYTES = 256 * 1024 * 1024


async def connect(url: str, name: str, *, connect_timeout_s: float = 30.0) -> NATS:
    """Connect with unlimited reconnects; retry the first connect until `connect_timeout_s` (services
    do not depend on start order)."""

    async def error_cb(exc: Exception) -> None:
        log.warning("nats error", error=repr(exc))

    async def disconnected_cb() -> None:
        log.warning("nats disconnected")

    async def reconnected_cb() -> None:
        log.info("nats reconnected")

    # Readiness (the side port's /readyz) fails from the first attempt until connected, and again
    # while disconnected; the check drops itself once the client is gone.
    pending = asyncio.get_running_loop().create_future()
    register_check(f"nats:{name}", _nats_check(pending))
    # With unlimited reconnects nats-py also retries the first connect forever: bound it here.
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                servers=[u.strip() for u in url.split(",")],
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                allow_reconnect=True,
                error_cb=error_cb,
                disconnected_cb=disconnected_cb,
                reconnected_cb=reconnected_cb,
                pending_size=DEFAULT_PENDING_BYTES,
            ),
            timeout=connect_timeout_s,
        )
        pending.set_result(weakref.ref(nc))
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise ConnectionError(f"cannot connect to NATS at {url} within {connect_timeout_s:.0f}s: {exc!r}") from exc
    finally:
        if not pending.done():  # failed or cancelled: nothing left to report on
            unregister_check(f"nats:{name}")
    return nc


def _nats_check(pending: asyncio.Future[weakref.ref[NATS]]) -> Callable[[], bool | None]:
    def check() -> bool | None:
        if not pending.done():
            return False  # still making the first connection
        nc = pending.result()()
        if nc is None or nc.is_closed:
            return None  # the client was closed or collected: the check no longer applies
        return nc.is_connected

    return check


def _config(spec: StreamSpec) -> StreamConfig:
    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.WORK_QUEUE if spec.retention == "workqueue" else RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        max_age=spec.max_age_s,
        max_bytes=spec.max_bytes,
        max_msg_size=spec.max_msg_size,
        duplicate_window=spec.duplicate_window_s,
        discard=DiscardPolicy.OLD,
    )


_COMPARED = ("subjects", "retention", "max_msgs_per_subject", "max_age", "max_bytes", "max_msg_size", "duplicate_window")


async def declare_streams(js: JetStreamContext, specs: Iterable[StreamSpec] | None = None) -> dict[str, str]:
    """Create each stream, or update it if its config differs; a stream that matches is left alone.
    Returns {name: "created" | "updated" | "unchanged"}."""
    result: dict[str, str] = {}
    for spec in specs if specs is not None else stream_specs():
        want = _config(spec)
        try:
            info = await js.stream_info(spec.name)
        except NotFoundError:
            await js.add_stream(want)
            result[spec.name] = "created"
            continue
        have = info.config
        if all(_same(getattr(have, f), getattr(want, f)) for f in _COMPARED):
            result[spec.name] = "unchanged"
            continue
        want.subjects = sorted(set(have.subjects or []) | set(want.subjects or []))
        await js.update_stream(want)
        result[spec.name] = "updated"
    return result


def _same(a: object, b: object) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return sorted(a) == sorted(b)
    if isinstance(a, float | int) and isinstance(b, float | int):
        return abs(float(a) - float(b)) < 1e-6
    return a == b
