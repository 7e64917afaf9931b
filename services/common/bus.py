"""NATS connection with reconnect, and idempotent declaration of the streams of docs/design.md."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, PubAck, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from schemas.subjects import StreamSpec, stream_specs
from services.common.busretry import RetryPolicy, retry, with_retries
from services.common.health import register_check, unregister_check
from services.common.logging import get_logger
from services.common.nats_auth import NatsAuth
from services.common.storefull import StoreAlarm

if TYPE_CHECKING:
    from services.common.settings import ServiceSettings

log = get_logger("bus")

T = TypeVar("T")

# Replies to requests larger than this go over several messages; keep a margin below max_payload.
DEFAULT_PENDING_BYTES = 256 * 1024 * 1024


DECLARE_BUDGET_S = 60.0
"""How long stream declaration rides out a bus that does not answer yet (a cluster still electing its
JetStream meta leader, a server restarting, first answers slow on a loaded machine)."""


DEFAULT_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True)
class Bus:
    """How one process talks to NATS: where, as whom, and the policy of every stream and bucket it
    declares. A service's entry point makes it once from its settings (`Bus.of`) and hands it to the
    service; nothing about the bus is process-wide. `Bus()` is a lone local server, declaring (the
    default of the objects a test or a tool builds by hand; a service passes its own)."""

    url: str = DEFAULT_URL
    """NATS server URL(s), comma-separated."""
    auth: NatsAuth | None = None
    """The credentials of every connection (None: none)."""
    replicas: int = 1
    """Replicas of every stream and of the WEIGHTS bucket this process declares (`nats_replicas`)."""
    declare: bool = True
    """Create or update streams and buckets (`bus_declare`); False: only look them up."""
    retry_budget_s: float = DECLARE_BUDGET_S
    """How long a call retried through `retries` rides out a bus that does not answer (the service's
    `bus_retry_timeout_s` where it has one, else DECLARE_BUDGET_S)."""
    retry: RetryPolicy = field(default_factory=RetryPolicy, compare=False)
    """What every retried call of the service shares: the store alarm (`nats_monitor_url`), the stop
    that ends the retries (`runner.supervise` binds it), the permissions violations its clients met.
    Shared by `as_user`'s copies."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"nats_replicas must be at least 1, got {self.replicas}")

    @classmethod
    def of(cls, settings: ServiceSettings) -> Bus:
        """The bus a service's settings describe (`nats_url`, `nats_auth`, `nats_replicas`, `bus_declare`,
        and `bus_retry_timeout_s` where the service has it), its store alarm asking `nats_monitor_url`."""
        return cls(settings.nats_url, settings.nats_auth, settings.nats_replicas, settings.bus_declare,
                   float(getattr(settings, "bus_retry_timeout_s", DECLARE_BUDGET_S)),
                   RetryPolicy(StoreAlarm(settings.nats_monitor_url)))

    def as_user(self, auth: NatsAuth | None, *, declare: bool | None = None) -> Bus:
        """This bus with other credentials (None: keep these), and a declare policy if given (a run's
        restricted user only looks the streams up)."""
        return replace(self, auth=self.auth if auth is None else auth, declare=self.declare if declare is None else declare)

    async def connect(self, name: str, *, connect_timeout_s: float = 30.0, url: str | None = None) -> NATS:
        """`connect` to this bus (or to `url`, a run's own server found at start) with its credentials."""
        return await connect(url or self.url, name, connect_timeout_s=connect_timeout_s, auth=self.auth, retry=self.retry)

    async def declare_streams(self, js: JetStreamContext, specs: Iterable[StreamSpec] | None = None, *,
                              budget_s: float = DECLARE_BUDGET_S, on_retry: Callable[[BaseException], None] | None = None
                              ) -> dict[str, str]:
        """`declare_streams` with this bus's replicas and declare policy."""
        return await declare_streams(js, specs, replicas=self.replicas, declare=self.declare, budget_s=budget_s, on_retry=on_retry,
                                     policy=self.retry)

    async def publish_acked(self, js: JetStreamContext, subject: str, data: bytes, *, timeout_s: float,
                            headers: dict[str, str] | None = None, stream: str | None = None) -> PubAck:
        """`publish_acked`: one acknowledged publish, bounded by `timeout_s`."""
        return await publish_acked(js, subject, data, timeout_s=timeout_s, headers=headers, stream=stream)

    async def retries(self, what: str, call: Callable[[], Awaitable[T]],
                      on_retry: Callable[[BaseException], None] | None = None) -> T:
        """`with_retries` within this bus's retry budget."""
        return await with_retries(what, call, self.retry_budget_s, on_retry, policy=self.retry)


class BusNotInitialized(RuntimeError):
    """A stream or bucket this service needs does not exist, and it is not allowed to create it."""


def not_initialized(what: str) -> BusNotInitialized:
    return BusNotInitialized(
        f"{what} does not exist and this service does not create it (bus_declare=false): "
        "run `jetrl bus init` with the admin user's credentials first"
    )


async def connect(url: str, name: str, *, connect_timeout_s: float = 30.0, auth: NatsAuth | None = None,
                  retry: RetryPolicy | None = None) -> NATS:
    """Connect with unlimited reconnects; retry the first connect until `connect_timeout_s` (services
    do not depend on start order). `auth` None: no credentials (a service connects through its
    `Bus`, which passes its own, and its `retry` policy, which keeps the permissions violations the
    server reports). A server that refuses the credentials, or a TLS handshake that
    fails, ends the attempt at once with the server's own error: retrying cannot fix either."""
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[BaseException] = loop.create_future()

    async def error_cb(exc: Exception) -> None:
        if not refused.done() and _is_refusal(exc):
            refused.set_result(exc)
        if retry is not None and "permissions violation" in str(exc).lower():
            retry.denials.append((time.monotonic(), str(exc)))
        log.warning("nats error", error=repr(exc))

    async def disconnected_cb() -> None:
        log.warning("nats disconnected")

    async def reconnected_cb() -> None:
        log.info("nats reconnected")

    # Readiness (the side port's /readyz) fails from the first attempt until connected, and again
    # while disconnected; the check drops itself once the client is gone.
    pending = loop.create_future()
    register_check(f"nats:{name}", _nats_check(pending))
    options = auth.connect_options() if auth is not None else {}
    servers = [u.strip() for u in url.split(",")]
    if options.get("tls") is not None:
        servers = [u.replace("nats://", "tls://", 1) for u in servers]
    # With unlimited reconnects nats-py also retries the first connect forever: bound it here.
    attempt = asyncio.create_task(
        nats.connect(
            servers=servers,
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=2,
            allow_reconnect=True,
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            pending_size=DEFAULT_PENDING_BYTES,
            **options,
        )
    )
    try:
        racers: set[asyncio.Future[Any]] = {attempt, refused}
        done, _ = await asyncio.wait(racers, timeout=connect_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if attempt in done:
            nc = attempt.result()
            pending.set_result(weakref.ref(nc))
            return nc
        attempt.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await attempt
        if refused.done():
            exc = refused.result()
            raise ConnectionRefusedError(f"NATS at {url} refused {name!r}: {exc} (check the nats_auth settings)") from exc
        raise ConnectionError(f"cannot connect to NATS at {url} within {connect_timeout_s:.0f}s")
    except (OSError, nats.errors.Error) as exc:
        if isinstance(exc, ConnectionError):
            raise
        raise ConnectionError(f"cannot connect to NATS at {url}: {exc!r}") from exc
    finally:
        if not pending.done():  # failed or cancelled: nothing left to report on
            unregister_check(f"nats:{name}")
        if not attempt.done():
            attempt.cancel()


async def close_connection(nc: NATS, timeout_s: float = 5.0) -> None:
    """End a connection at a stop: drained when the server is there (pending publishes flushed,
    subscriptions ended), closed at once when it is not (a reconnecting client cannot drain, and a
    stop never waits for a server that is gone); bounded by `timeout_s` either way."""
    if nc.is_closed:
        return
    if nc.is_connected:
        try:
            await asyncio.wait_for(nc.drain(), timeout=timeout_s)
            return
        except Exception as exc:  # the bus went away meanwhile, or the drain overran: close
            log.warning("nats drain failed; closing", error=repr(exc))
    else:
        log.warning("stopping with the bus unreachable: closing the connection without draining")
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), timeout=timeout_s)


async def publish_acked(js: JetStreamContext, subject: str, data: bytes, *, timeout_s: float,
                        headers: dict[str, str] | None = None, stream: str | None = None) -> PubAck:
    """Publish to a stream and wait for its acknowledgement, bounded by `timeout_s` (+1 s): nats-py may
    never resolve a publish the server answered with 429 (docs/reference/nats-notes.md). Every
    JetStream publisher goes through here; retrying is the caller's (`busretry.with_retries`)."""
    return await asyncio.wait_for(
        js.publish(subject, data, timeout=timeout_s, headers=headers, stream=stream), timeout=timeout_s + 1.0
    )


def _is_refusal(exc: BaseException) -> bool:
    """Errors no retry can fix: the server refused the credentials, or TLS could not be agreed."""
    if isinstance(exc, nats.errors.AuthorizationError | ssl.SSLError):
        return True
    text = str(exc).lower()
    return "authorization violation" in text or "authentication" in text or "user authentication expired" in text


def _nats_check(pending: asyncio.Future[weakref.ref[NATS]]) -> Callable[[], bool | None]:
    def check() -> bool | None:
        if not pending.done():
            return False  # still making the first connection
        nc = pending.result()()
        if nc is None or nc.is_closed:
            return None  # the client was closed or collected: the check no longer applies
        return nc.is_connected

    return check


def _config(spec: StreamSpec, replicas: int) -> StreamConfig:
    return StreamConfig(
        num_replicas=replicas,
        name=spec.name,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.WORK_QUEUE if spec.retention == "workqueue" else RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        max_age=spec.max_age_s,
        max_bytes=spec.max_bytes,
        max_msg_size=spec.max_msg_size,
        duplicate_window=spec.duplicate_window_s,
        discard=DiscardPolicy.NEW if spec.discard == "new" else DiscardPolicy.OLD,
    )


_COMPARED = ("subjects", "retention", "max_msgs_per_subject", "max_age", "max_bytes", "max_msg_size", "duplicate_window",
             "num_replicas", "discard")


async def declare_streams(js: JetStreamContext, specs: Iterable[StreamSpec] | None = None, *, replicas: int = 1,
                          declare: bool = True, budget_s: float = DECLARE_BUDGET_S,
                          on_retry: Callable[[BaseException], None] | None = None, policy: RetryPolicy | None = None
                          ) -> dict[str, str]:
    """Create each stream, or update it if its config differs; a stream that matches is left alone.
    `replicas` (a service's `nats_replicas`, through its `Bus`) is part of the config: a stream found with
    another replica count is scaled to it (NATS moves the data); a cluster too small for it is an
    error naming the stream and both counts. Returns {name: "created" | "updated" | "unchanged"}.

    `declare` False (`bus_declare=false`, a restricted NATS user): each stream is
    only looked up and used as it is configured (that is the admin's): a missing one is
    `BusNotInitialized` naming `jetrl bus init`; returns "found".

    Each JetStream call goes through `js_api_call`: a bus that does not answer yet (timeouts, no
    responders, 503) is waited out for `budget_s` (a service passes its own `bus_retry_timeout_s`);
    a permissions violation is `PermissionError` at once. `policy`: the service's (`Bus.declare_streams`
    passes it; None: a fresh one, for a test or a tool)."""
    if replicas < 1:
        raise ValueError(f"nats_replicas must be at least 1, got {replicas}")
    policy = policy if policy is not None else RetryPolicy()
    result: dict[str, str] = {}
    for spec in specs if specs is not None else stream_specs():
        want = _config(spec, replicas)
        try:
            info = await js_api_call(f"stream {spec.name}: info", functools.partial(js.stream_info, spec.name), budget_s, on_retry,
                                     policy=policy)
        except NotFoundError:
            if not declare:
                raise not_initialized(f"stream {spec.name}") from None
            try:
                await _placed(functools.partial(js_api_call, f"stream {spec.name}: create", functools.partial(js.add_stream, want),
                                                budget_s, on_retry, policy=policy))
            except nats.js.errors.APIError as exc:
                raise RuntimeError(f"stream {spec.name}: cannot create it with {replicas} replica(s): {exc}") from exc
            result[spec.name] = "created"
            continue
        if not declare:  # its configuration (sizes, ages, replicas) is the admin's
            result[spec.name] = "found"
            continue
        have = info.config
        have.num_replicas = have.num_replicas or 1
        if all(_same(getattr(have, f), getattr(want, f)) for f in _COMPARED):
            result[spec.name] = "unchanged"
            continue
        if (have.num_replicas or 1) != replicas:
            log.warning("stream has another replica count than asked; scaling it", stream=spec.name,
                        replicas_found=have.num_replicas or 1, replicas_wanted=replicas)
        want.subjects = sorted(set(have.subjects or []) | set(want.subjects or []))
        try:
            await js_api_call(f"stream {spec.name}: update", functools.partial(js.update_stream, want), budget_s, on_retry,
                              policy=policy)
        except nats.js.errors.APIError as exc:
            raise RuntimeError(f"stream {spec.name}: cannot update it (replicas {have.num_replicas or 1} -> {replicas}): {exc}") from exc
        result[spec.name] = "updated"
    return result


NO_PLACEMENT = 10005
"""JetStream's err_code for 'no suitable peers for placement': a cluster too small for the replicas,
or one just started whose meta leader does not know every peer yet."""
PLACEMENT_WAIT_S = 15.0
"""How long a create refused for placement is tried again (a cluster still forming), before the
refusal is the answer (a cluster too small)."""


async def _placed(call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, again while JetStream answers 'no suitable peers for placement', for up to
    PLACEMENT_WAIT_S (seen under load on a 3-node cluster right after it formed)."""
    return await retry(call, when=lambda exc: isinstance(exc, nats.js.errors.APIError) and exc.err_code == NO_PLACEMENT,
                       budget_s=PLACEMENT_WAIT_S, initial_s=0.2, max_s=2.0,
                       on_retry=lambda exc, _: log.warning("no suitable peers for placement yet; trying again (a cluster still forming?)",
                                                           error=str(exc)))


async def js_api_call(what: str, call: Callable[[], Awaitable[T]], budget_s: float = DECLARE_BUDGET_S,
                      on_retry: Callable[[BaseException], None] | None = None, *, policy: RetryPolicy) -> T:
    """A JetStream API call made at start (declaring streams, opening a bucket), retried through a bus
    that does not answer yet for up to `budget_s` (then `BusUnavailable`; `on_retry` sees each retry).
    A timeout after the server reported a permissions violation on the JetStream API (to a client of
    `policy`, the service's `Bus.retry`) is the user's rights, not the bus: `PermissionError` at once,
    with the server's words."""
    since = time.monotonic()

    def refuse_if_denied(exc: BaseException) -> None:
        denied = policy.denied_since(since)
        if denied:
            raise PermissionError(f"{what}: {denied[-1]}") from exc
        if on_retry is not None:
            on_retry(exc)

    return await with_retries(what, call, budget_s, on_retry=refuse_if_denied, policy=policy)


def _same(a: object, b: object) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return sorted(a) == sorted(b)
    if isinstance(a, float | int) and isinstance(b, float | int):
        return abs(float(a) - float(b)) < 1e-6
    return a == b


async def unsubscribe_quietly(sub: Any, what: str) -> None:
    """End a subscription at shutdown; if the bus is already gone, say so and go on (shutting down
    matters more, and a closed connection holds no subscription anyway). `sub` None: nothing to do."""
    if sub is None:
        return
    try:
        await sub.unsubscribe()
    except Exception as exc:
        log.warning(f"{what} unsubscribe failed", error=repr(exc))
