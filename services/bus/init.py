"""`jetrl bus init`: declare every stream and the WEIGHTS object store bucket once, as the admin NATS
user, with the run's replica count; afterwards the services run as restricted users with
`bus_declare=false` and only look them up."""

from __future__ import annotations

import functools

import nats.errors
from nats.js.errors import BucketNotFoundError

from schemas.subjects import WEIGHTS_BUCKET, stream_specs
from services.bus.settings import BusSettings
from services.common.bus import Bus, js_api_call
from services.common.busretry import BusUnavailable
from services.common.logging import get_logger
from services.weights.objstore import open_bucket

log = get_logger("bus")


async def init_bus(settings: BusSettings, bus: Bus) -> dict[str, str]:
    """Create or update the streams and create the bucket on `bus` (the settings' own); returns {name:
    what was done}. Idempotent: run it again after changing `nats_replicas` or a size cap and the
    streams are updated in place."""
    nc = await bus.connect("jetrl-bus-init", connect_timeout_s=settings.connect_timeout_s)
    try:
        js = nc.jetstream()
        specs = stream_specs(settings.trajectories_max_bytes, settings.trajectories_max_age_s, settings.metrics_max_age_s,
                             settings.trajectories_discard)
        done = await bus.declare_streams(js, specs)
        try:
            await js_api_call(f"bucket {WEIGHTS_BUCKET}: open", functools.partial(js.object_store, WEIGHTS_BUCKET), policy=bus.retry)
            done[f"bucket {WEIGHTS_BUCKET}"] = "unchanged"
        except BucketNotFoundError:
            await open_bucket(js, WEIGHTS_BUCKET, replicas=bus.replicas, declare=bus.declare, policy=bus.retry)
            done[f"bucket {WEIGHTS_BUCKET}"] = "created"
    except PermissionError as exc:  # the server reported a permissions violation on the JetStream API
        raise RuntimeError(
            f"{exc}: run `jetrl bus init` as the admin user (user {settings.nats_auth.user or '(none)'!r} may not create streams)"
        ) from exc
    except (nats.errors.TimeoutError, TimeoutError, BusUnavailable) as exc:
        raise RuntimeError(
            f"the JetStream API did not answer {settings.nats_auth.user or 'this client'!r}: run `jetrl bus init` "
            "as the admin user (a restricted user may not create streams), or check that JetStream is enabled"
        ) from exc
    finally:
        await nc.close()
    for name, what in done.items():
        log.info("declared", name=name, result=what, replicas=bus.replicas)
    return done


async def run(settings: BusSettings, bus: Bus) -> None:
    """The `service_main` target: declare, print one line per stream and bucket."""
    for name, what in (await init_bus(settings, bus)).items():
        print(f"{name}: {what}")
