"""Creating and deleting a service's JetStream consumers at its start, through `bus.js_api_call`.

Consumer calls need the cluster's JetStream meta leader (and the stream's leader): a service started
beside a cluster still forming, or while a node that led the stream has just died, meets timeouts and
503s until the cluster has elected again. Those are waited out within `DECLARE_BUDGET_S`, as stream
declaration waits them out; a permissions violation is `PermissionError` at once. A config the server
refuses (a 400-class answer) is no outage: it fails at once, naming the stream and the consumer.
"""

from __future__ import annotations

import functools

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, ConsumerInfo

from services.common.bus import js_api_call
from services.common.busretry import RetryPolicy


class ConsumerRefused(RuntimeError):
    """The server refused a consumer's config or its stream (no retry can fix it)."""


async def add_consumer(js: JetStreamContext, stream: str, config: ConsumerConfig, *, policy: RetryPolicy) -> ConsumerInfo:
    """Create the consumer (or find it as configured: an identical config is no change). A retry after
    a reply lost to the outage finds the consumer the first attempt made, so a consumer that is
    retried must have a name (durable or not): an unnamed one would be made twice. `policy`: the service's
    (`Bus.retry`)."""
    what = f"stream {stream}: consumer {config.durable_name or config.name or '(unnamed)'}"
    try:
        return await js_api_call(f"{what}: create", functools.partial(js.add_consumer, stream, config), policy=policy)
    except nats.js.errors.APIError as exc:  # retryable ones (503) were retried; what is left is the config's
        raise ConsumerRefused(f"{what}: the server refused to create it: {exc}") from exc


async def delete_consumer_if_present(js: JetStreamContext, stream: str, name: str, *, policy: RetryPolicy) -> bool:
    """Delete the consumer; False if there was none (or a retry found it already deleted by an attempt
    whose reply was lost)."""
    what = f"stream {stream}: consumer {name}"
    try:
        return await js_api_call(f"{what}: delete", functools.partial(js.delete_consumer, stream, name), policy=policy)
    except nats.js.errors.NotFoundError:
        return False
    except nats.js.errors.APIError as exc:
        raise ConsumerRefused(f"{what}: the server refused to delete it: {exc}") from exc
