"""When the announced weight version goes down because a trainer resumed from an older checkpoint
(a new publisher: a newer epoch), the weights agent loads it; a genuine signed announcement of an
older epoch, recorded and replayed, is refused and reported. A real nats-server, a real CPU inference
server and real agents as processes."""

from __future__ import annotations

import json
from pathlib import Path

import nats
import pytest

from schemas.messages import WeightsLoaded, WeightsLoadFailed, encode
from schemas.subjects import Subjects
from services.common.nats_server import free_port
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import InferenceEngine, ModelRequest, WeightUpdateMeta
from services.weights.sender.publisher import WeightPublisher, ensure_weight_sync_stream
from tests.support.weights import Stack, make_version, process, server_version, wait_healthy

RUN = "down"
KEY = "the-runs-announce-key"


def _said(log: Path, event: str) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if str(entry.get("event", "")).startswith(event):
            out.append(entry)
    return out


@pytest.mark.timeout(300)
async def test_a_resumed_trainers_lower_version_loads_and_a_replayed_older_announcement_is_refused(
    nats_url: str, tmp_path: Path, tiny_model: Path
) -> None:
    nc = await nats.connect(nats_url)
    await ensure_weight_sync_stream(nc)
    stack = Stack(nats_url, RUN, tmp_path, tiny_model)
    await stack.watch(nc)
    pub = WeightPublisher(nc, RUN, announce_key=KEY.encode())  # the object store: the agent keeps local copies (keep_local=1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = InferenceEngine(InferenceClientSettings(servers=[url]))
    cache = tmp_path / "cache0"
    try:
        with process(stack.server_args(port), tmp_path / "server.log") as server:
            await wait_healthy(url, server, tmp_path / "server.log")
            with process([*stack.agent_args(url, 0), f"trust.announce_key={KEY}"], tmp_path / "a0.log"):
                v5 = await pub.publish_dir(5, 5, make_version(tiny_model, tmp_path / "c5", 5))
                await stack.expect(WeightsLoaded, 5, 1)

                # a trainer resumed from an older checkpoint (a publisher of its own): version 2 under
                # a newer epoch, loaded, not refused as older
                resumed = WeightPublisher(nc, RUN, announce_key=KEY.encode())
                v2 = await resumed.publish_dir(2, 2, make_version(tiny_model, tmp_path / "c2", 2))
                assert v2.epoch > v5.epoch
                await stack.expect(WeightsLoaded, 2, 1)
                assert await server_version(url) == "2"
                resp = await engine.agenerate(ModelRequest(input_ids=[1, 5], max_new_tokens=4, ignore_eos=True))
                assert resp.output_versions == [2] * 4
                # the copy of v5 is from before the version went down: dropped, not kept as the "newest"
                assert sorted(p.name for p in cache.iterdir()) == ["v2"]
            said = _said(tmp_path / "a0.log", "announced version is older than the one served")
            assert [(e["version"], e["serving"]) for e in said] == [(2, 5)]

            # an agent started beside a server that holds a higher version than the latest announcement
            # (here loaded directly) loads the announced one at once
            await engine.update_weights(WeightUpdateMeta(path=str(tmp_path / "c5"), version=5))
            assert await server_version(url) == "5"
            with process([*stack.agent_args(url, 0), f"trust.announce_key={KEY}"], tmp_path / "a1.log"):
                await stack.expect(WeightsLoaded, 2, 1)
                assert await server_version(url) == "2"

                # the genuine, signed v5 announcement, recorded and replayed: refused and reported,
                # and the server stays on v2
                await nc.jetstream().publish(Subjects(RUN).weights_published, encode(v5))
                failed = await stack.expect(WeightsLoadFailed, 5, 1)
                assert "a replay" in failed[0].reason, failed
                assert await server_version(url) == "2"
            refused = _said(tmp_path / "a1.log", "weights announcement refused")
            assert [(e["cause"], e["version"]) for e in refused] == [("replayed", 5)]
    finally:
        await engine.aclose()
        await nc.close()
