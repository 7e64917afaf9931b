"""Weights in memory under ZeRO-3: `jetrl trainer` as 2 CPU ranks (torchrun, gloo) broadcasts each
version to two real CPU inference servers, gathering the weights bucket by bucket while the buckets
before are on the wire. The servers receive the trainer's parameters bit for bit, rank 0 never holds
more than two buckets of gathered weights, and a server SIGKILLed between versions costs the trainer
a rebuilt group and a second gather of that version, not a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from schemas.messages import MetricsEvent, WeightsLoaded, WeightsLoadFailed, WeightsPublished, decode
from schemas.subjects import METRICS_STREAM, WEIGHT_SYNC_STREAM, Subjects
from services.common.bus import connect, declare_streams
from services.common.ports import free_port
from tests.support.inference import running_servers
from tests.support.trainer import REPO, kill_group, make_group, publish_group

RUN = "z3bc"
BUCKET_MB = 0.05


def start_zero3_trainer(nats_url: str, model: Path, out: Path, servers: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "services.trainer", f"run={RUN}", f"nats_url={nats_url}",
           f"model_path={model}", f"output_dir={out}", "feeder.enabled=false", "batch_groups=2", "eta=100",
           "checkpoint_every=0", "zero_stage=3", "seed=0", "ppo.n_minibatches=1",
           "total_steps=4", "fetch_timeout_s=0.2", "log_format=json", "weights.transport=broadcast",
           f"weights.disk_dir={out.parent / 'shared'}", f"weights.servers={','.join(servers)}",
           f"weights.bucket_mb={BUCKET_MB}", "weights.timeout_s=20", "weights.disk_every=2"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(out.parent / "trainer.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def served(url: str, name: str) -> torch.Tensor:
    body = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}, timeout=30).json()
    return torch.tensor(body, dtype=torch.float32)


def disk_copy(shared: Path, version: int) -> dict[str, torch.Tensor]:
    """The trainer's parameters of `version` as its disk copy holds them (gathered in full, float32)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted((shared / f"v{version}").glob("*.safetensors")):
        out.update(load_file(f))
    assert out, f"no disk copy of v{version}"
    return out


@pytest.mark.timeout(600)
async def test_zero3_two_ranks_stream_the_gather_into_the_broadcast(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "trainer"
    out.mkdir()
    shared = tmp_path / "shared"
    with running_servers(tiny_model, tmp_path, 2) as (a, b):
        nc = await connect(nats_url, "test")
        js = nc.jetstream()
        await declare_streams(js)
        subjects = Subjects(RUN)
        loaded = {s.url: await js.subscribe(subjects.weights_loaded(s.url), stream=WEIGHT_SYNC_STREAM, ordered_consumer=True)
                  for s in (a, b)}
        failed_b = await js.subscribe(subjects.weights_failed(b.url), stream=WEIGHT_SYNC_STREAM, ordered_consumer=True)
        announced = await js.subscribe(subjects.weights_published, stream=WEIGHT_SYNC_STREAM, ordered_consumer=True)

        async def step(first: int) -> None:  # two groups: one trainer step
            for i in (first, first + 1):
                await publish_group(js, RUN, f"p{i}", make_group(tiny_model, f"{i:03d}", seed=i))

        async def disk_version(version: int) -> None:
            while True:
                msg = decode(WeightsPublished, (await announced.next_msg(timeout=180)).data)
                if (msg.version, msg.transport) == (version, "disk"):
                    return

        trainer = start_zero3_trainer(nats_url, tiny_model, out, [a.url, b.url])
        try:
            for version in (1, 2):
                await step(2 * version)
                for s in (a, b):
                    report = decode(WeightsLoaded, (await loaded[s.url].next_msg(timeout=240)).data)
                    assert (report.version, report.transport) == (version, "broadcast")
            # the disk copy of version 2 is the trainer's parameters gathered in full: both servers hold
            # exactly them, every parameter (the trainer is waiting for its next groups meanwhile)
            await disk_version(2)
            trained = disk_copy(shared, 2)
            for s in (a, b):
                for name, tensor in trained.items():
                    assert torch.equal(served(s.url, name), tensor), (s.url, name)

            b.stop(signal.SIGKILL)  # the group's next broadcast to it fails: rebuilt, the version gathered again
            for version in (3, 4):
                await step(2 * version)
                report = decode(WeightsLoaded, (await loaded[a.url].next_msg(timeout=240)).data)
                assert (report.server, report.version) == (a.url, version)
            assert trainer.wait(timeout=120) == 0
            failure = decode(WeightsLoadFailed, (await failed_b.next_msg(timeout=10)).data)
            assert failure.version == 3 and failure.transport == "broadcast"
            await disk_version(4)
            trained = disk_copy(shared, 4)
            for name, tensor in trained.items():
                assert torch.equal(served(a.url, name), tensor), name

            # rank 0 held at most two buckets of gathered weights at once, in every version, the
            # rebuilt one included (a bucket is one tensor when the tensor is larger than bucket_mb)
            msub = await js.subscribe(subjects.metrics("weights_broadcast"), stream=METRICS_STREAM, ordered_consumer=True)
            events = [decode(MetricsEvent, (await msub.next_msg(timeout=10)).data) for _ in range(4)]
            largest = max(t.numel() * t.element_size() for t in trained.values())
            bucket = max(int(BUCKET_MB * 1e6), largest)
            for e in events:
                v = e.values
                assert 0 < v["broadcast_held_peak_bytes"] <= 2 * bucket, (e.version, v)
                assert v["broadcast_bytes"] >= 3 * v["broadcast_held_peak_bytes"], (e.version, v)  # never the whole model
            assert events[2].values["broadcast_rebuilds"] >= 1 and events[2].values["broadcast_members"] == 1
        except (AssertionError, TimeoutError, subprocess.TimeoutExpired):
            print((tmp_path / "trainer.log").read_text()[-6000:])
            raise
        finally:
            kill_group(trainer)
            await nc.close()
