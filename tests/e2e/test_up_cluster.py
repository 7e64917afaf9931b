"""The whole pipeline on a real 3-node JetStream cluster on 127.0.0.1 (`jetrl up bus=external` with
every stream at 3 replicas): mid-run the leader of TRAJECTORIES is SIGKILLed and restarted later,
then the leader of PROMPTS. The run finishes; counted from the streams themselves, no prompt was lost and none
trained twice; the restarted nodes catch up."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from schemas.headers import is_rejection
from schemas.subjects import PROMPTS_STREAM, TRAJECTORIES_STREAM, Subjects
from schemas.trajectory import decode_group
from services.bus.nats_cluster import NatsCluster
from services.bus.nats_server import NatsServer
from services.common.bus import connect
from tests.support.up import DEMO, finish, start_up, step_of
from tests.support.waiting import wait_until

RUN = "e2e-cluster"
# progress lines come at the display's refresh, not every step: a fast run skips step numbers, so the
# plan leaves room after the second kill for its restart
STEPS = 30


async def leaders(url: str) -> dict[str, str]:
    nc = await connect(url, "e2e-leaders")
    js = nc.jetstream()
    out = {name: str((await js.stream_info(name)).cluster.leader) for name in (TRAJECTORIES_STREAM, PROMPTS_STREAM)}  # type: ignore[union-attr]
    await nc.close()
    return out


async def recorded_and_current(url: str) -> tuple[list[str], bool]:
    """Prompt ids of every recorded group (read through an ordered consumer), and whether every
    replica of TRAJECTORIES is current."""
    nc = await connect(url, "e2e-check")
    js = nc.jetstream()
    info = await js.stream_info(TRAJECTORIES_STREAM)
    sub = await js.subscribe(Subjects(RUN).trajectories, ordered_consumer=True, stream=TRAJECTORIES_STREAM)
    ids = []
    while True:
        try:
            msg = await sub.next_msg(timeout=3)
        except Exception:
            break
        if not is_rejection(msg.headers):
            ids.append(decode_group(msg.data).meta.prompt_id)
        if msg.metadata.sequence.stream >= info.state.last_seq:
            break
    current = all(r.current for r in (info.cluster.replicas or [])) and len(info.cluster.replicas or []) == 2  # type: ignore[union-attr]
    await nc.close()
    return ids, current


@pytest.mark.timeout(1200)
def test_up_on_a_three_node_cluster_survives_losing_the_stream_leaders(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path / "cluster", 3).start()
    config = {**DEMO, "up": {"bus": "external", "nats_url": cluster.url, "nats_replicas": 3}}
    try:
        proc = start_up(tmp_path, RUN, STEPS, config)
        # one node down at a time: R3 keeps a quorum of two (two nodes down at once would stop writes)
        plan = [(4, TRAJECTORIES_STREAM), (12, PROMPTS_STREAM)]
        killed: list[tuple[str, str]] = []
        down: NatsServer | None = None
        restart_at = 0
        restarted = 0
        lines: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            step = step_of(line)
            if down is None and plan and step >= plan[0][0]:
                stream = plan.pop(0)[1]
                name = asyncio.run(leaders(cluster.url))[stream]
                down = cluster.node_named(name)
                down.kill()
                killed.append((stream, name))
                restart_at = step + 3
            elif down is not None and step >= restart_at:
                down.restart()
                down, restarted = None, restarted + 1
        out = "".join(lines) + finish(proc, timeout=900)
        assert len(killed) == 2 and restarted == 2, (killed, out[-3000:])
        assert proc.returncode == 0, out[-4000:]
        assert f"step {STEPS}/{STEPS}" in out

        run_dir = tmp_path / RUN
        trained = [pid for row in map(json.loads, (run_dir / "trainer" / "steps.jsonl").read_text().splitlines())
                   for pid in row.get("prompt_ids", [])]
        assert len(trained) == STEPS * 16 and len(set(trained)) == len(trained), "a prompt was trained twice"
        last = json.loads((run_dir / "metrics.json").read_text())["steps"][-1]
        assert last["feeder_dropped"] == 0

        wait_until("the restarted node to catch up on the stream", lambda: asyncio.run(recorded_and_current(cluster.url))[1],
                   timeout_s=120, interval_s=1)
        recorded, _ = asyncio.run(recorded_and_current(cluster.url))
        assert len(recorded) == len(set(recorded)), "a result was recorded twice"
        assert set(trained) <= set(recorded), "a trained group is missing from the recording"
    finally:
        cluster.stop()
