"""The agent through nats-server kills, beside a real CPU inference server: it never dies while the bus
is away, and once it is back the agent loads the latest announced version it had missed, with
nothing new published."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

from schemas.messages import WeightsPublished
from services.common.bus import connect
from services.common.metrics import MetricsPublisher
from services.common.nats_server import NatsServer, free_port
from services.weights.agent.agent import WeightsAgent
from services.weights.agent.server_client import ServerClient
from services.weights.sender.publisher import WeightPublisher, ensure_weight_sync_stream
from services.weights.settings import WeightsSettings
from tests.support.weights import Stack, make_version, process, server_version, wait_healthy

RUN = "wresync"


class KillBeforeLoading(WeightsAgent):
    """The agent, with the bus killed between an announcement's arrival and the start of its fetch."""

    kill_before: int | None = None
    on_kill: Callable[[], None] = staticmethod(lambda: None)

    async def load(self, target: WeightsPublished) -> bool:
        if target.version == self.kill_before:
            self.kill_before = None  # once
            self.on_kill()
        return await super().load(target)


async def until(cond: Callable[[], bool], what: str, tasks: list[asyncio.Task], timeout_s: float = 120) -> None:
    """Poll `cond` (the agent's own state) until true; the agent's tasks must stay alive meanwhile."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        for t in tasks:
            assert not t.done(), f"agent task {t.get_name()} ended: {t.exception() if not t.cancelled() else 'cancelled'!r}"
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for: {what}"
        await asyncio.sleep(0.05)


async def test_agent_survives_bus_kills_and_loads_what_it_missed_once_back(tmp_path: Path, tiny_model: Path) -> None:
    nats_server = NatsServer(tmp_path / "nats", port=free_port()).start()  # restarted on the same port and store
    stack = Stack(nats_server.url, RUN, tmp_path, tiny_model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # short budgets, so that the download of v2 gives up while the bus is down
    settings = WeightsSettings(run=RUN, server=url, cache_dir=str(tmp_path / "cache"), bus_retry_timeout_s=2.0,
                               chunk_timeout_s=1.0, report_retry_s=1.0)

    def kill() -> None:
        assert nats_server.proc is not None
        nats_server.proc.kill()
        nats_server.proc.wait()

    stopping = asyncio.Event()
    tasks: list[asyncio.Task] = []
    with process(stack.server_args(port), tmp_path / "server.log") as inference:
        await wait_healthy(url, inference, tmp_path / "server.log")
        agent_nc = await connect(nats_server.url, "agent-under-test")  # reconnects forever, as the agent's does
        pub_nc = await connect(nats_server.url, "trainer")
        http = ServerClient(url, 60.0)
        try:
            pub = WeightPublisher(pub_nc, RUN, keep_last=3)
            agent = KillBeforeLoading(agent_nc, http, settings, MetricsPublisher(agent_nc, RUN, "weights", "s0"))
            agent.loaded_version = await http.get_weight_version()
            agent.on_kill = kill
            await ensure_weight_sync_stream(agent_nc)  # as the agent's start does
            tasks = [asyncio.create_task(agent.listen(stopping), name="listen"),
                     asyncio.create_task(agent.load_loop(stopping), name="loader")]

            await pub.publish_dir(1, 1, make_version(tiny_model, tmp_path / "c1", 1))
            await until(lambda: agent.loaded_version == 1, "v1 loaded", tasks)

            # v2 is announced; the bus dies as the agent starts to fetch it, and stays down until the
            # download has given up (bus_retry_timeout_s).
            agent.kill_before = 2
            await pub.publish_dir(2, 2, make_version(tiny_model, tmp_path / "c2", 2))
            await until(lambda: agent.metrics.counters["load_failures"] >= 1, "the fetch of v2 given up", tasks)
            assert agent.loaded_version == 1
            await asyncio.to_thread(nats_server.start)
            # nothing new is published: the agent re-reads the last announcement and loads v2
            await until(lambda: agent.loaded_version == 2, "v2 loaded after the restart", tasks)
            assert await server_version(url) == "2"

            # Down again; a version announced as soon as the server is back (before the agent's old
            # subscription could have been noticed gone) is loaded too.
            kill()
            await until(lambda: not agent_nc.is_connected, "the agent noticed the outage", tasks)
            await asyncio.to_thread(nats_server.start)
            await pub.publish_dir(3, 3, make_version(tiny_model, tmp_path / "c3", 3))
            await until(lambda: agent.loaded_version == 3, "v3 loaded", tasks)
            assert await server_version(url) == "3"
            assert agent.metrics.counters["resyncs"] >= 2
        finally:
            stopping.set()
            await _settle(tasks)
            await http.aclose()
            for conn in (agent_nc, pub_nc):
                with contextlib.suppress(Exception):  # nats-py's close can raise while it reconnects
                    await conn.close()
            nats_server.stop()


async def _settle(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(t, 10)
