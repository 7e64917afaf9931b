"""Run `jetrl status` once: connect, collect each section, print it.

A section the bus does not answer (a cluster that lost its majority, a server restarting) is shown
as unanswered, with the error, beside the ones that answered; the exit code is then 2."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from services.common.bus import Bus
from services.common.nats_auth import NatsAuth
from services.common.storefull import describe, store_errors
from services.runs import MONITOR_URL_FILE, URL_FILE, run_auth
from services.status.answers import answered
from services.status.feeder import feeder_status, render_feeder
from services.status.groups import render_groups, trainer_groups
from services.status.rollout import render_rollout, rollout_outcomes
from services.status.settings import StatusSettings
from services.status.streams import bus_status, render_bus
from services.status.weights import render_weights, weights_status

T = TypeVar("T")
INCOMPLETE = 2
"""The exit code when some part got no answer from the bus."""


def nats_url_for(settings: StatusSettings) -> str:
    """An explicit nats_url wins; otherwise a live `jetrl up` run's own server (runs/<run>/nats.url)."""
    live = Path(settings.run_dir) / settings.run / URL_FILE
    if "nats_url" not in settings.model_fields_set and live.exists():
        return live.read_text().strip()
    return settings.nats_url


def nats_auth_for(settings: StatusSettings) -> NatsAuth | None:
    """Explicit `nats_auth` wins; on a `jetrl up` run's own server (no nats_url given), the run's
    `observer` user from its run directory (None: the process's default)."""
    if "nats_auth" in settings.model_fields_set or "nats_url" in settings.model_fields_set:
        return None
    return run_auth(Path(settings.run_dir) / settings.run, "observer")


def monitor_url_for(settings: StatusSettings) -> str:
    """An explicit nats_monitor_url; else a live `jetrl up` run's embedded server's ("": none to ask)."""
    live = Path(settings.run_dir) / settings.run / MONITOR_URL_FILE
    if settings.nats_monitor_url or "nats_url" in settings.model_fields_set or not live.exists():
        return settings.nats_monitor_url
    return live.read_text().strip()


async def full_streams(settings: StatusSettings, unanswered: dict[str, str]) -> dict[str, str]:
    """{stream: write error} for each stream the store cannot write (the server's health report)."""
    url = monitor_url_for(settings)
    if not url:
        return {}
    try:
        return await asyncio.to_thread(store_errors, url, settings.timeout_s)
    except OSError as exc:
        unanswered["store"] = f"{url}: {exc}"
        return {}


async def run_status(settings: StatusSettings, bus: Bus) -> None:
    """`bus`: the settings' own; a live run's server and its observer user are found by themselves."""
    nc = await bus.as_user(nats_auth_for(settings)).connect("jetrl-status", connect_timeout_s=settings.timeout_s,
                                                          url=nats_url_for(settings))
    unanswered: dict[str, str] = {}
    t = settings.timeout_s
    try:  # asked together: during an outage each waits its timeout for nothing
        weights, streams, feeder, groups, rollout, full = await asyncio.gather(
            answered("weights", weights_status(nc, settings.run, t), unanswered),
            answered("bus", bus_status(nc, settings.run, t, settings.alive_within_s), unanswered),
            answered("feeder", feeder_status(nc, settings.run, t), unanswered),
            answered("groups", trainer_groups(nc, settings.run, t), unanswered),
            answered("rollout", rollout_outcomes(nc, settings.run, t), unanswered),
            full_streams(settings, unanswered),
        )
    finally:
        await nc.close()
    if streams is not None:
        unanswered.update(streams.unanswered)
    parts = {"weights": weights, "bus": streams, "feeder": feeder, "groups": groups, "rollout": rollout}
    if settings.format == "json":
        out = {name: None if part is None else part.as_dict() for name, part in parts.items()}
        print(json.dumps({**out, "store_full": full, "unanswered": unanswered}, indent=2))
    else:
        def shown(name: str, part: T | None, render: Callable[[T], str]) -> str:
            return render(part) if part is not None else f"{name}: NO ANSWER from the bus: {unanswered[name]}"

        if full:  # first: nothing else moves until space returns
            print(f"{describe(full)}: the run waits until space returns (docs/security.md \"A full disk\")")
            for stream, error in sorted(full.items()):
                print(f"  {stream}: {error}")
        print(shown("weights", weights, render_weights))
        print(shown("bus", streams, render_bus))
        print(shown("feeder", feeder, render_feeder))
        print(shown("groups", groups, render_groups))
        print(shown("rollout", rollout, render_rollout))
    if unanswered:
        raise SystemExit(INCOMPLETE)  # what is shown is incomplete: scripts must not take it for the whole
