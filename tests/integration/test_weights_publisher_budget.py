"""The weight publisher waits for a silent bus as long as it was told (`bus_retry_timeout_s`, the
trainer's setting), also when it first declares the WEIGHT_SYNC stream: then it gives up with
`BusUnavailable` naming the call, and its retry counter (the trainer's `bus_retries` metric) saw each
wait. (That declaration went through a fixed 60 s budget of its own before, inside the publisher's
retry loop: a trainer told to give up after 2 s waited 60, and its counter saw nothing.)"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from services.common.bus import connect
from services.common.busretry import BusUnavailable
from services.common.nats_server import NatsServer
from services.weights.sender.publisher import WeightPublisher


@pytest.mark.timeout(120)  # the old code gave up only after 60 s, then failed the last assertion
async def test_the_publisher_gives_up_on_its_own_budget_when_declaring_its_stream(nats_server: NatsServer, tmp_path: Path) -> None:
    nc = await connect(nats_server.url, "trainer")
    retries: list[BaseException] = []
    publisher = WeightPublisher(nc, "budget", bus_retry_timeout_s=1.0, on_retry=retries.append)
    nats_server.kill()
    try:
        with pytest.raises(BusUnavailable, match="stream WEIGHT_SYNC"):
            await publisher.publish_dir(1, 1, tmp_path)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    assert retries, "the publisher's retry counter saw none of the waits"
