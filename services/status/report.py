"""Run `jetrl status` once: connect, collect each section, print it."""

from __future__ import annotations

import json

from services.common.bus import connect
from services.status.settings import StatusSettings
from services.status.weights import render_weights, weights_status


async def run_status(settings: StatusSettings) -> None:
    nc = await connect(settings.nats_url, "jetrl-status", connect_timeout_s=settings.timeout_s)
    try:
        weights = await weights_status(nc, settings.run, settings.timeout_s)
    finally:
        await nc.close()
    if settings.format == "json":
        print(json.dumps({"weights": weights.as_dict()}, indent=2))
    else:
        print(render_weights(weights))
