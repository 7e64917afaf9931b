"""Weights in memory: the in-process trainer broadcasts each version over gloo to two real CPU
inference servers (`python -m services.inference`), against a real nats-server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from schemas.messages import WeightsLoaded, WeightsPublished, decode
from schemas.subjects import WEIGHT_SYNC_STREAM, Subjects
from services.common.bus import connect
from services.trainer.engine import TrainEngine
from services.trainer.loop import Trainer
from services.trainer.settings import TrainerSettings
from services.trainer.service import _broadcast_publisher
from services.weights.publisher import WeightPublisher
from tests.integration.conftest_inference import running_servers
from tests.integration.conftest_trainer import make_group, publish_group, take_prompts, write_dataset

RUN = "bc"


def server_weights(url: str, name: str) -> torch.Tensor:
    """A parameter as the server holds it (SGLang's /get_weights_by_name, untruncated)."""
    body = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}, timeout=30).json()
    return torch.tensor(body, dtype=torch.float32)


def server_version(url: str) -> str:
    return str(httpx.get(f"{url}/get_weight_version", timeout=10).json()["weight_version"])


@pytest.mark.timeout(240)
async def test_versions_arrive_by_broadcast_bit_for_bit(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    with running_servers(tiny_model, tmp_path, 2) as servers:
        urls = [s.url for s in servers]
        settings = TrainerSettings(
            run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), zero_stage=2,
            batch_groups=2, eta=10, checkpoint_every=0, fetch_timeout_s=0.2, weights_shared_dir=str(tmp_path / "shared"),
            feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 50)), "max_in_flight": 8},
            weights_broadcast={"enabled": True, "servers": ",".join(urls), "bucket_mb": 0.05, "disk_every": 2},
        )
        nc = await connect(nats_url, "test")
        publisher = WeightPublisher(nc, RUN, shared_dir=settings.weights_shared_dir)
        bcast = _broadcast_publisher(settings, nc, publisher)
        assert bcast is not None
        trainer = Trainer(settings, TrainEngine(settings), broadcast=bcast)
        await trainer.start(nc)
        js = nc.jetstream()
        subjects = Subjects(RUN)
        loaded = {u: await js.subscribe(subjects.weights_loaded(u), stream=WEIGHT_SYNC_STREAM, ordered_consumer=True) for u in urls}
        announced = await js.subscribe(subjects.weights_published, stream=WEIGHT_SYNC_STREAM, ordered_consumer=True)
        try:
            for version in (1, 2, 3):
                await trainer.feed_once()
                tasks = await take_prompts(js, subjects.prompts_train, subjects.rollout_consumer, 2)
                for i, t in enumerate(tasks):
                    await publish_group(js, RUN, t.prompt_id, make_group(tiny_model, t.data["answer"], seed=version * 10 + i))
                assert await trainer.step() is not None and trainer.version == version

                # every server reports the version, and serves exactly the trainer's parameters
                result = bcast.history[-1]
                assert sorted(result.loaded) == sorted(urls) and result.failed == {} and result.buckets > 1
                for u in urls:
                    report = decode(WeightsLoaded, (await loaded[u].next_msg(timeout=10)).data)
                    assert (report.version, report.server, report.transport) == (version, u, "broadcast")
                    assert server_version(u) == str(version)
                trained = trainer.engine.full_state_dict()
                assert trained is not None
                for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
                    for u in urls:
                        assert torch.equal(server_weights(u, name), trained[name]), (u, name)

                # the announcement says how it travelled; every 2nd version is also written to disk
                pubs = [decode(WeightsPublished, (await announced.next_msg(timeout=10)).data)]
                if version % 2 == 0:
                    pubs.append(decode(WeightsPublished, (await announced.next_msg(timeout=10)).data))
                assert pubs[0].transport == "broadcast" and pubs[0].version == version
                assert sorted(pubs[0].members) == sorted(urls) and pubs[0].dtype == "float32"
                if version % 2 == 0:
                    assert pubs[1].transport == "disk" and pubs[1].version == version
                    assert (tmp_path / "shared" / f"v{version}" / "model.safetensors").exists()
                else:
                    assert not (tmp_path / "shared" / f"v{version}").exists()
                assert pubs[0].disk_version == (None if version <= 2 else 2)  # the disk copy is written after the broadcast
        finally:
            await bcast.aclose()
            await trainer.close()
            await nc.close()
