"""Publishing as fast as it can: a real agent process beside a real CPU inference server keeps up with
2,000 versions and the object store's stream never holds more than a few consumers."""

from __future__ import annotations

from pathlib import Path

import nats
import pytest

from schemas.messages import WeightsLoaded
from schemas.subjects import WEIGHTS_BUCKET
from services.common.nats_server import free_port
from services.weights.sender.publisher import WeightPublisher, ensure_weight_sync_stream
from tests.support.trainer import until
from tests.support.weights import Stack, make_version, process, server_version, wait_healthy

VERSIONS = 2000
MAX_CONSUMERS = 8
"""A flat bound, not a growing count: the agent's fetch consumers (one per file being read, each
deleted when read) and the publisher's transient listing. A delete may still be in flight as the next
is made, more so on a loaded machine: a count above the bound must come back under it within
`SETTLE_S` (a leak never does). The old agent held 22 by version 10; nats-server refuses the 1,001st."""
SETTLE_S = 10.0


@pytest.mark.timeout(900)
async def test_agent_keeps_up_with_thousands_of_versions_holding_few_consumers(
    nats_url: str, tmp_path: Path, tiny_model: Path
) -> None:
    nc = await nats.connect(nats_url)
    try:
        await ensure_weight_sync_stream(nc)
        js = nc.jetstream()
        stack = Stack(nats_url, "wfast", tmp_path, tiny_model)
        await stack.watch(nc)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        ckpt = make_version(tiny_model, tmp_path / "ckpt", 1)  # the same bytes as every version: only the number counts
        pub = WeightPublisher(nc, "wfast", keep_last=2)
        consumers: list[int] = []

        async def count_consumers() -> int:
            n = (await js.stream_info(f"OBJ_{WEIGHTS_BUCKET}")).state.consumer_count
            consumers.append(n)
            return n

        async def within_bound() -> bool:
            return await count_consumers() <= MAX_CONSUMERS

        with (
            process(stack.server_args(port), tmp_path / "server.log") as server,
            process(stack.agent_args(url, 0), tmp_path / "agent.log") as agent,
        ):
            await wait_healthy(url, server, tmp_path / "server.log")
            await pub.publish_dir(1, 1, ckpt)
            await stack.expect(WeightsLoaded, 1, 1)  # the agent is following before the flood starts
            loads = 1
            for v in range(2, VERSIONS + 1):
                await pub.publish_dir(v, v, ckpt)
                while not stack.reports.empty():  # the agent keeps loading while versions pour in
                    loads += isinstance(stack.reports.get_nowait(), WeightsLoaded)
                if v % 10 == 0:
                    assert agent.poll() is None, f"agent exited at v{v}:\n{(tmp_path / 'agent.log').read_text()[-3000:]}"
                    if await count_consumers() > MAX_CONSUMERS:
                        await until(f"v{v}: the {consumers[-1]} consumers on the object store to settle to {MAX_CONSUMERS}",
                                    within_bound, SETTLE_S)

            # current: it ends on the last version (the versions it skipped were superseded, not failed)
            await stack.expect(WeightsLoaded, VERSIONS, 1)
            assert await server_version(url) == str(VERSIONS)
            assert agent.poll() is None
            assert await count_consumers() <= MAX_CONSUMERS, consumers
            assert loads > 1, "the agent loaded nothing while versions were being published"
    finally:
        await nc.close()
