"""Weights through shared memory on one host: the trainer's `ColocatedSender` hands each version to
real CPU inference servers (`python -m services.inference`) with SGLang's `/update_weights_from_tensor`,
the tensors passed by shared-memory handle."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from schemas.messages import WeightsLoaded, WeightsLoadFailed, WeightsPublished, decode
from schemas.subjects import WEIGHT_SYNC_STREAM, Subjects
from schemas.tensor_payload import PayloadError, deserialize, serialize
from services.common.bus import connect
from services.trainer.loop import Trainer
from services.trainer.model.engine import TrainEngine
from services.trainer.service import weight_sync
from services.weights.sender.colocated import ColocatedSender
from services.weights.sender.memory import MemoryWeights
from tests.integration.test_weights_broadcast import (
    _model_state,
    _stream_until_first_token,
    broadcast_trainer,
    generated_version,
    server_version,
    server_weights,
    train_one,
)
from tests.support.inference import running_servers

RUN = "bc"
NAMES = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight")


@pytest.mark.timeout(240)
async def test_the_trainer_hands_each_version_over_in_shared_memory_bit_for_bit(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    with running_servers(tiny_model, tmp_path, 2) as servers:
        urls = [s.url for s in servers]
        settings = broadcast_trainer(nats_url, tiny_model, tmp_path, urls, disk_every=2, transport="colocated")
        nc = await connect(nats_url, "test")
        sync = weight_sync(settings, nc)
        assert isinstance(sync, MemoryWeights) and isinstance(sync.publisher.broadcaster, ColocatedSender)
        bcast = sync.publisher
        trainer = Trainer(settings, TrainEngine(settings), weights=sync)
        await trainer.start(nc)
        js, subjects = nc.jetstream(), Subjects(RUN)
        loaded = {u: await js.subscribe(subjects.weights_loaded(u), stream=WEIGHT_SYNC_STREAM, ordered_consumer=True) for u in urls}
        announced = await js.subscribe(subjects.weights_published, stream=WEIGHT_SYNC_STREAM, ordered_consumer=True)
        try:
            for version in (1, 2, 3):
                await train_one(trainer, tiny_model)
                result = bcast.history[-1]
                assert sorted(result.loaded) == sorted(urls) and result.failed == {} and result.buckets > 1
                for u in urls:
                    report = decode(WeightsLoaded, (await loaded[u].next_msg(timeout=10)).data)
                    assert (report.version, report.transport) == (version, "colocated")
                    assert server_version(u) == str(version) == generated_version(u)
                trained = trainer.engine.full_state_dict()
                assert trained is not None
                for name in NAMES:
                    for u in urls:
                        assert torch.equal(server_weights(u, name), trained[name]), (u, name)
                pub = decode(WeightsPublished, (await announced.next_msg(timeout=10)).data)
                assert (pub.transport, pub.version, sorted(pub.members)) == ("colocated", version, sorted(urls))
                if version % 2 == 0:  # the disk copy every disk_every versions, for servers that missed one
                    assert decode(WeightsPublished, (await announced.next_msg(timeout=10)).data).transport == "disk"
            # the servers serve from the trainer's buffers: two sets, written alternately, suffice
            assert len(bcast.broadcaster.pool.sets) == 2
        finally:
            await trainer.close()
            await bcast.aclose()
            await nc.close()


def test_a_payload_naming_anything_but_tensors_is_refused_before_it_runs() -> None:
    import base64
    import os
    import pickle

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    with pytest.raises(PayloadError, match="never needs"):
        deserialize(base64.b64encode(pickle.dumps([("x", Evil())])).decode())
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    ((n, back),) = deserialize(serialize([("w", t)]))
    assert n == "w" and torch.equal(back, t) and back.is_shared()


async def _copied_or_adopted_in_bf16_and_bad_requests_refused(url: str, tiny_model: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    for v, adopt in ((1, False), (2, True)):
        sender = ColocatedSender([url], dtype="bfloat16", bucket_mb=0.05, adopt=adopt, timeout_s=30)
        try:
            state = _model_state(tiny_model, 0.01 * v)
            assert (await sender.send_version(v, state)).loaded == [url]
            # the fp32 server holds exactly the bf16 values sent, copied or adopted
            assert torch.equal(server_weights(url, name), state[name].to(torch.bfloat16).float())
        finally:
            await sender.aclose()
    async with httpx.AsyncClient(timeout=30) as http:
        bad = serialize([(name, torch.zeros(3, 3).share_memory_())])
        r = await http.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": [bad], "weight_version": "9"})
        assert r.status_code == 400 and "shape mismatch" in r.json()["message"]
        r = await http.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": ["bm90IGEgcGlja2xl"]})
        assert r.status_code == 400 and "does not load" in r.json()["message"]
    assert server_version(url) == "2" == generated_version(url)  # the refused requests changed nothing


@pytest.mark.timeout(240)
async def test_one_server_copies_or_adopts_refuses_bad_updates_and_generates_across_updates(tiny_model: Path, tmp_path: Path) -> None:
    with running_servers(tiny_model, tmp_path, 1) as (server,):
        await _copied_or_adopted_in_bf16_and_bad_requests_refused(server.url, tiny_model)
        sender = ColocatedSender([server.url], bucket_mb=0.05, timeout_s=30)
        body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}, "stream": True}
        try:
            assert (await sender.send_version(1, _model_state(tiny_model, 0.01))).loaded == [server.url]
            async with httpx.AsyncClient() as http:
                for version in range(2, 7):  # until a completion spans an update (decode speed is the machine's)
                    ctx, lines = await _stream_until_first_token(http, server.url, body)
                    try:
                        assert (await sender.send_version(version, _model_state(tiny_model, 0.01 * version))).loaded == [server.url]
                        last = None
                        async for line in lines:
                            if line.startswith("data: {"):
                                last = json.loads(line[6:])
                    finally:
                        await ctx.__aexit__(None, None, None)
                    assert last is not None
                    meta = last["meta_info"]
                    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 500
                    spans = meta["weight_versions"]
                    if len(spans) > 1:
                        break
                assert [s["version"] for s in spans] == [str(version - 1), str(version)], spans
        finally:
            await sender.aclose()


@pytest.mark.timeout(240)
async def test_a_stalled_or_killed_server_does_not_hang_the_trainer(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    """The other server gets every version while one server stalls mid-update (given up on after
    `timeout_s`), is killed mid-update (given up on at once, the connection lost) and is down
    (unreachable); each is reported failed with its cause."""
    from services.weights.sender.broadcast_publish import BroadcastPublisher

    with running_servers(tiny_model, tmp_path, 2) as (a, b):
        nc = await connect(nats_url, "test")
        sender = ColocatedSender([a.url, b.url], bucket_mb=0.05, timeout_s=3.0)
        pub = BroadcastPublisher(nc, RUN, sender, None, 0, background=False)
        js, subjects = nc.jetstream(), Subjects(RUN)

        async def reason(version: int) -> str:
            report = decode(WeightsLoadFailed, (await failed.next_msg(timeout=10)).data)
            assert (report.version, report.transport) == (version, "colocated")
            return report.reason

        try:
            assert sorted((await pub.publish(1, _model_state(tiny_model, 0.01), None)).members) == sorted([a.url, b.url])
            failed = await js.subscribe(subjects.weights_failed(b.url), stream=WEIGHT_SYNC_STREAM, ordered_consumer=True)
            # stalled: given up on after timeout_s
            b.proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            msg = await pub.publish(2, _model_state(tiny_model, 0.02), None)
            assert time.monotonic() - t0 < 3.0 + 15 and msg is not None and msg.members == [a.url]
            assert "no answer within" in await reason(2)
            # killed mid-update: its connection drops, the trainer goes on at once (not after timeout_s)
            sender.timeout_s = 600.0
            publish = asyncio.ensure_future(pub.publish(3, _model_state(tiny_model, 0.03), None))
            async with httpx.AsyncClient(timeout=10) as http:
                while (await http.get(f"{a.url}/model_info")).json()["weight_version"] != "3":
                    await asyncio.wait([publish], timeout=0.05)  # the other server has it, b's request is pending
            assert not publish.done()
            b.stop(signal.SIGKILL)
            t0 = time.monotonic()
            msg = await asyncio.wait_for(publish, 120)
            assert time.monotonic() - t0 < 60 and msg is not None and msg.members == [a.url]
            assert "connection lost during the update" in await reason(3)
            # down: unreachable
            msg = await pub.publish(4, _model_state(tiny_model, 0.04), None)
            assert msg is not None and msg.members == [a.url] and "unreachable" in await reason(4)
            assert server_version(a.url) == "4"
            assert torch.equal(server_weights(a.url, "model.norm.weight"), _model_state(tiny_model, 0.04)["model.norm.weight"])
            # the dead server's hold on its buffers is gone: the pool is back to two sets
            assert (await pub.publish(5, _model_state(tiny_model, 0.05), None)) is not None
            assert len(sender.pool.sets) <= 2
        finally:
            if b.proc.poll() is None:
                b.proc.send_signal(signal.SIGCONT)
            await pub.aclose()
            await nc.close()
