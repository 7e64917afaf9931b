"""A multi-node trainer through torchrun's own rendezvous: `jetrl trainer` as 2 nodes x 1 rank on
loopback (two launchers, as two machines would run them) with ZeRO-3 trains on the same recorded
groups as 1 node x 2 ranks and publishes the same weights, bit for bit."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.bus import connect, declare_streams
from services.common.ports import free_port
from tests.support.trainer import REPO, make_group, publish_group

STEPS, GROUPS = 2, 2


def torchrun(nats_url: str, model: Path, run: str, out: Path, *, nnodes: int, node_rank: int, nproc: int, port: int,
             log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node_rank}",
           f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "services.trainer",
           f"run={run}", f"nats_url={nats_url}", f"model_path={model}", f"output_dir={out}", "feeder.enabled=false",
           f"batch_groups={GROUPS}", "eta=100", "checkpoint_every=0", "zero_stage=3", "seed=0", "ppo.n_minibatches=1",
           "weights.transport=shared_dir", f"weights.dir={out.parent / (run + '-published')}", f"total_steps={STEPS}",
           "fetch_timeout_s=0.2", "log_format=json"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def finish(procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    try:
        for proc, log in zip(procs, logs, strict=True):
            assert proc.wait(420) == 0, log.read_text()[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


@pytest.mark.timeout(900)
def test_two_nodes_of_one_rank_publish_the_weights_of_one_node_of_two_ranks(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    groups = [make_group(tiny_model, f"{i:03d}", seed=i) for i in range(STEPS * GROUPS)]

    async def publish(run: str) -> None:
        nc = await connect(nats_url, "test")
        js = nc.jetstream()
        await declare_streams(js)
        for i, g in enumerate(groups):
            await publish_group(js, run, f"p{i}", g)
        await nc.close()

    for run in ("one-node", "two-nodes"):
        asyncio.run(publish(run))

    single = tmp_path / "one-node"
    logs = [tmp_path / "one-node.log"]
    finish([torchrun(nats_url, tiny_model, "one-node", single, nnodes=1, node_rank=0, nproc=2, port=free_port(), log=logs[0])], logs)

    multi = tmp_path / "two-nodes"
    port = free_port()
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    procs = [torchrun(nats_url, tiny_model, "two-nodes", multi, nnodes=2, node_rank=i, nproc=1, port=port, log=logs[i]) for i in range(2)]
    finish(procs, logs)

    def weights(root: Path) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f in sorted((root.parent / (root.name + '-published') / f"v{STEPS}").glob("*.safetensors")):
            out.update(load_file(f))
        return out

    a, b = weights(single), weights(multi)
    assert a and a.keys() == b.keys()
    initial = load_file(next(tiny_model.glob("*.safetensors")))
    assert any(not torch.equal(a[k], initial[k]) for k in a if k in initial), "the runs did not train"
    for name in a:
        assert torch.equal(a[name], b[name]), name
