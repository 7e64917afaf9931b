"""Weights in memory: the in-process trainer broadcasts each version over gloo to two real CPU
inference servers (`python -m services.inference`), against a real nats-server."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from schemas.messages import MetricsEvent, WeightsLoaded, WeightsLoadFailed, WeightsPublished, decode
from schemas.subjects import METRICS_STREAM, WEIGHT_SYNC_STREAM, Subjects
from services.common.bus import Bus, connect
from services.status.weights import render_weights, weights_status
from services.trainer.loop import Trainer
from services.trainer.model.engine import TrainEngine
from services.trainer.service import weight_sync
from services.trainer.settings import TrainerSettings
from services.weights.sender.memory import MemoryWeights
from services.weights.sender.publisher import WeightPublisher
from tests.support.inference import running_servers
from tests.support.trainer import make_group, publish_group, take_prompts, write_dataset

RUN = "bc"


def server_weights(url: str, name: str) -> torch.Tensor:
    """A parameter as the server holds it (SGLang's /get_weights_by_name, untruncated)."""
    body = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}, timeout=30).json()
    return torch.tensor(body, dtype=torch.float32)


def server_version(url: str) -> str:
    return str(httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"])


def generated_version(url: str) -> str:
    """The weight version a short generation reports (the server still serves)."""
    gen = httpx.post(f"{url}/generate", json={"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 3}}, timeout=30)
    assert gen.status_code == 200, gen.text
    return str(gen.json()["meta_info"]["weight_version"])


async def train_one(trainer: Trainer, tiny_model: Path) -> None:
    """Act as the rollout side for one step: take B prompts, answer them, let the trainer step."""
    assert trainer.nc is not None
    js, subjects, version = trainer.nc.jetstream(), trainer.subjects, trainer.version + 1
    await trainer.feeder.feed_once()
    tasks = await take_prompts(js, subjects.prompts_train, subjects.rollout_consumer, trainer.settings.batch_groups)
    for i, t in enumerate(tasks):
        await publish_group(js, trainer.settings.run, t.prompt_id, make_group(tiny_model, t.data["answer"], seed=version * 10 + i))
    assert await trainer.step() is not None and trainer.version == version
    if isinstance(trainer.weights, MemoryWeights):  # the version goes out while the next step trains: wait for it
        await trainer.weights.publisher.wait()


def broadcast_trainer(nats_url: str, tiny_model: Path, tmp_path: Path, urls: list[str], **broadcast: object) -> TrainerSettings:
    return TrainerSettings(
        run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), zero_stage=2,
        batch_groups=2, eta=10, checkpoint_every=0, fetch_timeout_s=0.2,
        feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 50)), "max_in_flight": 8},
        weights={"transport": "broadcast", "servers": ",".join(urls), "bucket_mb": 0.05, "disk_dir": str(tmp_path / "shared"),
                 **broadcast},
    )


@pytest.mark.timeout(240)
async def test_versions_arrive_by_broadcast_bit_for_bit(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    with running_servers(tiny_model, tmp_path, 2) as servers:
        urls = [s.url for s in servers]
        settings = broadcast_trainer(nats_url, tiny_model, tmp_path, urls, disk_every=2)
        nc = await connect(nats_url, "test")
        sync = weight_sync(settings, nc, Bus.of(settings))  # as the entry point makes it
        assert isinstance(sync, MemoryWeights)
        bcast = sync.publisher
        trainer = Trainer(settings, TrainEngine(settings), weights=sync)
        await trainer.start(nc)
        js = nc.jetstream()
        subjects = Subjects(RUN)
        loaded = {u: await js.subscribe(subjects.weights_loaded(u), stream=WEIGHT_SYNC_STREAM, ordered_consumer=True) for u in urls}
        announced = await js.subscribe(subjects.weights_published, stream=WEIGHT_SYNC_STREAM, ordered_consumer=True)
        try:
            for version in (1, 2, 3):
                await train_one(trainer, tiny_model)

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

            # per-version metrics of the broadcast
            msub = await js.subscribe(subjects.metrics("weights_broadcast"), stream=METRICS_STREAM, ordered_consumer=True)
            events = [decode(MetricsEvent, (await msub.next_msg(timeout=5)).data) for _ in range(3)]
            assert [e.version for e in events] == [1, 2, 3]
            assert all(e.values["broadcast_members"] == 2 and e.values["broadcast_failed"] == 0 for e in events)

            # `jetrl status` says how the weights travel
            status = await weights_status(nc, RUN)
            assert (status.published_version, status.transport, status.members, status.disk_version) == (3, "broadcast", 2, 2)
            assert {(s.server, s.loaded_version, s.transport) for s in status.servers} == {(u, 3, "broadcast") for u in urls}
            text = render_weights(status)
            assert "v3" in text and "by broadcast to 2 server(s); latest disk copy v2" in text
        finally:
            await bcast.aclose()
            await trainer.close()
            await nc.close()


def _model_state(model_dir: Path, shift: float) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return {n: p.detach() + shift for n, p in model.named_parameters()}


@pytest.mark.timeout(180)
async def test_a_corrupted_bucket_is_refused_and_the_old_weights_keep_serving(tiny_model: Path, tmp_path: Path) -> None:
    from services.weights.sender.broadcast import WeightBroadcaster
    from services.weights.sender.buckets import Bucket, make_buckets

    with running_servers(tiny_model, tmp_path, 2) as servers:
        urls = [s.url for s in servers]
        sender = WeightBroadcaster(urls, dtype="bfloat16", bucket_mb=0.05, timeout_s=30)
        try:
            v1 = _model_state(tiny_model, 0.01)
            assert sorted((await sender.send_version(1, v1)).loaded) == sorted(urls)
            name = "model.layers.0.mlp.up_proj.weight"
            served = {u: server_weights(u, name) for u in urls}
            assert all(torch.equal(w, v1[name].to(torch.bfloat16).float()) for w in served.values())

            # version 2: a bit flips on the way in the second bucket (sent with the checksum of the true
            # bytes), the version pipelined as the trainer sends it: the later buckets arrive intact
            # but are refused too, and nothing of version 2 is swapped in
            buckets = make_buckets(_model_state(tiny_model, 0.02), torch.bfloat16, sender.bucket_bytes)
            assert len(buckets) > 3
            damaged = [t.clone() for t in buckets[1].tensors]
            damaged[0].view(torch.int16).view(-1)[7] ^= 1
            buckets[1] = Bucket(buckets[1].names, damaged, buckets[1].checksum)
            refused = await sender._send_buckets(buckets, 2)
            assert set(refused) == set(urls) and all("checksum mismatch" in why for why in refused.values()), refused
            for u in urls:  # old weights, old version
                assert server_version(u) == "1"
                assert torch.equal(server_weights(u, name), served[u])
                assert generated_version(u) == "1"

            # the group is still in step: the next clean version lands
            v3 = _model_state(tiny_model, 0.03)
            assert sorted((await sender.send_version(3, v3)).loaded) == sorted(urls)
            for u in urls:
                assert server_version(u) == "3" and torch.equal(server_weights(u, name), v3[name].to(torch.bfloat16).float())
        finally:
            await sender.aclose()


@pytest.mark.timeout(180)
async def test_sigkill_of_one_server_mid_broadcast_the_other_gets_the_version(tiny_model: Path, tmp_path: Path) -> None:
    import signal
    import time

    from services.weights.sender.broadcast import GroupBroken, WeightBroadcaster
    from services.weights.sender.buckets import make_buckets

    deadline = 20.0
    with running_servers(tiny_model, tmp_path, 2) as (a, b):
        sender = WeightBroadcaster([a.url, b.url], bucket_mb=0.05, timeout_s=deadline)
        try:
            assert sorted((await sender.send_version(1, _model_state(tiny_model, 0.01))).loaded) == sorted([a.url, b.url])
            v2 = _model_state(tiny_model, 0.02)
            buckets = make_buckets(v2, torch.float32, sender.bucket_bytes)
            assert await sender._send_bucket(buckets[0], None) == {}  # both hold the first bucket of version 2
            b.stop(signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(GroupBroken):  # the broadcast to a dead member fails, within the deadline
                await sender._send_bucket(buckets[1], None)
            result = await sender.send_version(2, v2)  # the group rebuilt from the live server; version sent again
            assert time.monotonic() - t0 < 2 * deadline + 10
            assert result.loaded == [a.url] and b.url in result.failed
            name = "model.layers.1.self_attn.o_proj.weight"
            assert server_version(a.url) == "2" and torch.equal(server_weights(a.url, name), v2[name])
            # and training goes on: the next version reaches the survivor at once
            assert (await sender.send_version(3, _model_state(tiny_model, 0.03))).loaded == [a.url]
            assert server_version(a.url) == "3"
        finally:
            await sender.aclose()


@pytest.mark.timeout(300)
async def test_a_server_started_after_version_5_catches_up_from_disk_then_gets_6_by_broadcast(
    nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    from tests.support.inference import free_port
    from tests.support.waiting import wait_http_ok, wait_until
    from tests.support.weights import process

    with running_servers(tiny_model, tmp_path, 1) as (a,):
        port = free_port()
        late_url = f"http://127.0.0.1:{port}"  # named to the trainer from the start, started after version 5
        settings = broadcast_trainer(nats_url, tiny_model, tmp_path, [a.url, late_url], disk_every=4)
        nc = await connect(nats_url, "test")
        sync = weight_sync(settings, nc, Bus.of(settings))  # as the entry point makes it
        assert isinstance(sync, MemoryWeights)
        bcast = sync.publisher
        trainer = Trainer(settings, TrainEngine(settings), weights=sync)
        await trainer.start(nc)
        js = nc.jetstream()
        late_loaded = await js.subscribe(Subjects(RUN).weights_loaded(late_url), stream=WEIGHT_SYNC_STREAM, ordered_consumer=True)
        try:
            for _ in range(5):
                await train_one(trainer, tiny_model)
            assert [r.loaded for r in bcast.history] == [[a.url]] * 5
            assert all(late_url in r.failed for r in bcast.history)  # down: reported, not waited for
            assert server_version(a.url) == "5"

            # the late server comes up with its agent: the last announcement is the broadcast of
            # version 5, which names the latest disk copy (version 4): it catches up from there
            with process(["-m", "services.inference", f"model_path={tiny_model}", f"port={port}"], tmp_path / "late.log") as proc:
                wait_http_ok(f"{late_url}/health", timeout_s=90, proc=proc, log=tmp_path / "late.log")
                with process(["-m", "services.weights", f"server={late_url}", f"nats_url={nats_url}", f"run={RUN}",
                              f"cache_dir={tmp_path / 'cache'}", f'weight_roots=["{(tmp_path / "shared").as_uri()}"]'],
                             tmp_path / "agent.log") as agent:
                    report = decode(WeightsLoaded, (await late_loaded.next_msg(timeout=60)).data)
                    assert (report.version, report.transport) == (4, "disk"), (tmp_path / "agent.log").read_text()[-3000:]
                    wait_until("the late server to serve version 4", lambda: server_version(late_url) == "4", timeout_s=30, proc=agent)

                    # version 6 reaches both servers by broadcast
                    await train_one(trainer, tiny_model)
                    assert sorted(bcast.history[-1].loaded) == sorted([a.url, late_url])
                    report = decode(WeightsLoaded, (await late_loaded.next_msg(timeout=10)).data)
                    assert (report.version, report.transport) == (6, "broadcast")
                    trained = trainer.engine.full_state_dict()
                    assert trained is not None
                    name = "model.layers.1.mlp.down_proj.weight"
                    for u in (a.url, late_url):
                        assert server_version(u) == "6" and torch.equal(server_weights(u, name), trained[name])
        finally:
            await bcast.aclose()
            await trainer.close()
            await nc.close()


@pytest.mark.timeout(180)
async def test_a_version_goes_out_while_the_trainer_goes_on_and_the_next_waits_for_it(
    nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    from services.weights.sender.broadcast import WeightBroadcaster
    from services.weights.sender.broadcast_publish import BroadcastPublisher

    with running_servers(tiny_model, tmp_path, 1) as (server,):
        nc = await connect(nats_url, "test")
        disk = WeightPublisher(nc, RUN, shared_dir=str(tmp_path / "shared"))
        bcast = BroadcastPublisher(nc, RUN, WeightBroadcaster([server.url], bucket_mb=0.05, timeout_s=30), disk, disk_every=2)
        try:
            # publish returns at once: the version is sent while the trainer goes on
            assert await bcast.publish(1, _model_state(tiny_model, 0.01), None) is None
            assert bcast.history == []
            # the next version waits for it; its checkpoint directory is taken over at once, since
            # the trainer deletes that directory as soon as publish returns
            hf_dir = tmp_path / "out" / "v2"
            shutil.copytree(tiny_model, hf_dir)
            assert await bcast.publish(2, _model_state(tiny_model, 0.02), hf_dir) is None
            assert [r.version for r in bcast.history] == [1] and bcast.history[0].loaded == [server.url]
            assert not hf_dir.exists()
            done = await bcast.wait()
            assert done is not None and (done.version, done.transport) == (2, "disk")
            assert [r.loaded for r in bcast.history] == [[server.url], [server.url]]
            assert server_version(server.url) == "2"
            assert (tmp_path / "shared" / "v2" / "model.safetensors").exists()
            assert list((tmp_path / "out").iterdir()) == []  # nothing of the checkpoint left behind
            assert await bcast.wait() is None  # nothing in flight
        finally:
            await bcast.aclose()
            await nc.close()


async def _stream_until_first_token(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[Any, AsyncIterator[str]]:
    """Open a streamed /generate; returns (response context, line iterator) once a token was made."""
    ctx = http.stream("POST", f"{url}/generate", json=body, timeout=120)
    resp = await ctx.__aenter__()
    lines = resp.aiter_lines()
    async for line in lines:
        if line.startswith("data: {") and json.loads(line[6:])["output_ids"]:
            break
    return ctx, lines


@pytest.mark.timeout(180)
async def test_generation_goes_on_across_an_update_and_a_completion_spans_both_versions(tiny_model: Path, tmp_path: Path) -> None:
    from services.weights.sender.broadcast import WeightBroadcaster

    with running_servers(tiny_model, tmp_path, 1) as (server,):
        sender = WeightBroadcaster([server.url], bucket_mb=0.05, timeout_s=30)
        body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}, "stream": True}
        try:
            assert (await sender.send_version(1, _model_state(tiny_model, 0.01))).loaded == [server.url]
            async with httpx.AsyncClient() as http:
                # A completion that finished before the update landed spans one version: try again
                # with the next version (the decode speed is the machine's, not the test's).
                for version in range(2, 7):
                    ctx, lines = await _stream_until_first_token(http, server.url, body)
                    try:
                        result = await sender.send_version(version, _model_state(tiny_model, 0.01 * version))
                        assert result.loaded == [server.url]
                        last = None
                        async for line in lines:
                            if line.startswith("data: {"):
                                last = json.loads(line[6:])
                    finally:
                        await ctx.__aexit__(None, None, None)
                    assert last is not None
                    meta = last["meta_info"]
                    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 500  # never interrupted
                    spans = meta["weight_versions"]
                    if len(spans) > 1:
                        break
                assert [s["version"] for s in spans] == [str(version - 1), str(version)], spans
                assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 500
        finally:
            await sender.aclose()


@pytest.mark.timeout(180)
async def test_a_server_that_refuses_to_join_is_left_out_and_the_others_are_served(tiny_model: Path, tmp_path: Path) -> None:
    from services.weights.sender.broadcast import WeightBroadcaster
    from services.weights.sender.update_group import SHUN_VERSIONS

    with running_servers(tiny_model, tmp_path, 1) as (real,), running_servers(None, tmp_path, 1, "simulate=true") as (sim,):
        sender = WeightBroadcaster([real.url, sim.url], bucket_mb=0.05, timeout_s=5)
        try:
            first = await sender.send_version(1, _model_state(tiny_model, 0.01))
            assert first.loaded == [real.url] and "simulate mode" in first.failed[sim.url]
            # asked again only after SHUN_VERSIONS versions: meanwhile no group is rebuilt for it
            for version in range(2, 4):
                result = await sender.send_version(version, _model_state(tiny_model, 0.01 * version))
                assert result.loaded == [real.url] and result.rebuilds == 0
                assert f"left out until version {1 + SHUN_VERSIONS}" in result.failed[sim.url]
            assert server_version(real.url) == "3" and server_version(sim.url) == "0"
        finally:
            await sender.aclose()


@pytest.mark.timeout(300)
async def test_trainer_process_broadcasts_and_carries_on_when_a_server_is_sigkilled(
    nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    """`python -m services.trainer` with weights_broadcast: versions reach both servers; one server is
    SIGKILLed after version 1; the trainer finishes its steps and the other server gets every version."""
    import signal
    import subprocess

    from services.common.bus import declare_streams
    from tests.support.trainer import SERVICE_RUN, kill_group, start_trainer

    out = tmp_path / "trainer"
    out.mkdir()
    with running_servers(tiny_model, tmp_path, 2) as (a, b):
        nc = await connect(nats_url, "test")
        js = nc.jetstream()
        await declare_streams(js)
        subjects = Subjects(SERVICE_RUN)
        loaded = {s.url: await js.subscribe(subjects.weights_loaded(s.url), stream=WEIGHT_SYNC_STREAM, ordered_consumer=True)
                  for s in (a, b)}
        failed_b = await js.subscribe(subjects.weights_failed(b.url), stream=WEIGHT_SYNC_STREAM, ordered_consumer=True)

        async def publish(first: int, n: int) -> None:
            for i in range(first, first + n):
                await publish_group(js, SERVICE_RUN, f"p{i}", make_group(tiny_model, f"{i:03d}", seed=i))

        trainer = start_trainer(nats_url, tiny_model, out, "total_steps=3", "checkpoint_every=0",
                                "weights.transport=broadcast", f"weights.disk_dir={tmp_path / 'shared'}",
                                f"weights.servers={a.url},{b.url}", "weights.timeout_s=20", "weights.disk_every=2")
        try:
            await publish(0, 2)
            for s in (a, b):
                report = decode(WeightsLoaded, (await loaded[s.url].next_msg(timeout=180)).data)
                assert (report.version, report.transport) == (1, "broadcast")
            b.stop(signal.SIGKILL)
            await publish(2, 4)
            for version in (2, 3):
                report = decode(WeightsLoaded, (await loaded[a.url].next_msg(timeout=120)).data)
                assert (report.server, report.version) == (a.url, version)
            assert trainer.wait(timeout=120) == 0
            assert server_version(a.url) == "3"
            failure = decode(WeightsLoadFailed, (await failed_b.next_msg(timeout=10)).data)
            assert failure.version == 2 and failure.transport == "broadcast"
            assert (tmp_path / "shared" / "v2" / "model.safetensors").exists()  # the disk copy, every 2nd version
        except (AssertionError, TimeoutError, subprocess.TimeoutExpired):
            print(next(tmp_path.glob("trainer-*.log")).read_text()[-4000:])
            raise
        finally:
            kill_group(trainer)
            await nc.close()
