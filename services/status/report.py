"""Run `jetrl status` once: connect, collect each section, print it."""

from __future__ import annotations

import json
from pathlib import Path

from services.common.bus import connect
from services.runs import URL_FILE
from services.status.feeder import feeder_status, render_feeder
from services.status.groups import render_groups, trainer_groups
from services.status.settings import StatusSettings
from services.status.streams import bus_status, render_bus
from services.status.weights import render_weights, weights_status


def nats_url_for(settings: StatusSettings) -> str:
    """An explicit nats_url wins; otherwise a live `jetrl up` run's own server (runs/<run>/nats.url)."""
    live = Path(settings.run_dir) / settings.run / URL_FILE
    if "nats_url" not in settings.model_fields_set and live.exists():
        return live.read_text().strip()
    return settings.nats_url


async def run_status(settings: StatusSettings) -> None:
    nc = await connect(nats_url_for(settings), "jetrl-status", connect_timeout_s=settings.timeout_s)
    try:
        weights = await weights_status(nc, settings.run, settings.timeout_s)
        bus = await bus_status(nc, settings.run, settings.timeout_s, settings.alive_within_s)
        feeder = await feeder_status(nc, settings.run, settings.timeout_s)
        groups = await trainer_groups(nc, settings.run, settings.timeout_s)
    finally:
        await nc.close()
    if settings.format == "json":
        out = {"weights": weights.as_dict(), "bus": bus.as_dict(), "feeder": feeder.as_dict(), "groups": groups.as_dict()}
        print(json.dumps(out, indent=2))
    else:
        print(render_weights(weights))
        print(render_bus(bus))
        print(render_feeder(feeder))
        print(render_groups(groups))
