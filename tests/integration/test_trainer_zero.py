"""ZeRO across ranks, with real processes: the same batch trained by ZeRO-2 on 1 rank and on 2 CPU
ranks gives the same loss and updated weights; ZeRO-3 at 2 ranks gathers the same weights, and the HF
checkpoint it writes reloads equal to what was gathered.

The file doubles as the worker script (`torchrun ... test_trainer_zero.py --worker OUT STAGES`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _batch(model_path: str) -> dict:
    from services.trainer.intake.batch import collate
    from tests.support.trainer import make_group

    groups = [make_group(model_path, d, group_size=4, seed=i) for i, d in enumerate(["123", "405", "777"])]
    # Perturb the behaviour log-probs so the decoupled weight and the clip both matter.
    for i, g in enumerate(groups):
        g["logprobs"] = (g["logprobs"] * (1.0 + 0.1 * (i + 1))).astype("float32")
    return collate(groups)


def worker(out: Path, stages: list[int], model_path: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from services.trainer.intake.batch import shard
    from services.trainer.model.actor import PPOActor
    from services.trainer.model.collective import Command, execute
    from services.trainer.model.engine import TrainEngine
    from services.trainer.settings import TrainerSettings

    for stage in stages:
        # shards of ~0.2 MB: the tiny model's published weights come in several files
        s = TrainerSettings(model_path=model_path, zero_stage=stage, seed=0, ppo={"n_minibatches": 2}, weights_shard_mb=0.2)
        engine = TrainEngine(s)
        actor = PPOActor(engine, s.ppo)
        batch = actor.compute_advantages(_batch(model_path))
        pieces = shard(batch, engine.world_size, s.ppo.n_minibatches)[engine.rank]
        res = execute(engine, actor, Command("train", pieces=pieces, weights_dir=str(out / f"hf-z{stage}-w{engine.world_size}")))
        gathered = engine.full_state_dict()
        if engine.rank == 0:
            save_file({k: v.contiguous() for k, v in gathered.items()}, str(out / f"gathered-z{stage}-w{engine.world_size}.safetensors"))
            (out / f"stats-z{stage}-w{engine.world_size}.json").write_text(json.dumps(res.stats))
        del engine, actor
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def _launch(out: Path, nproc: int, stages: str, model: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    from services.common.nats_server import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           __file__, "--worker", str(out), stages, str(model)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, output.decode()[-4000:]


def test_zero2_two_ranks_match_one_rank_and_zero3_saves_reloadable_weights(tiny_model: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from services.inference.weights import read_checkpoint

    _launch(tmp_path, 1, "2", tiny_model)
    _launch(tmp_path, 2, "2,3", tiny_model)
    stats = {k: json.loads((tmp_path / f"stats-{k}.json").read_text()) for k in ("z2-w1", "z2-w2", "z3-w2")}
    for key in ("loss", "pg_loss", "entropy", "clip_fraction", "imp_weight_mean", "grad_norm"):
        assert abs(stats["z2-w2"][key] - stats["z2-w1"][key]) <= 1e-5 * max(1.0, abs(stats["z2-w1"][key])), key
        assert abs(stats["z3-w2"][key] - stats["z2-w1"][key]) <= 1e-5 * max(1.0, abs(stats["z2-w1"][key])), key
    assert stats["z2-w1"]["imp_weight_mean"] != 1.0  # the decoupled weight was active

    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    ref = load_file(tmp_path / "gathered-z2-w1.safetensors")
    assert any(not torch.equal(ref[k], initial[k]) for k in ref)  # the step changed the weights
    for name in ("z2-w2", "z3-w2"):
        got = load_file(tmp_path / f"gathered-{name}.safetensors")
        assert got.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5, msg=f"{name} {k}")
        # the HF dir written by rank 0 (in shards) reloads to exactly the gathered weights, in float32,
        # through transformers and through the inference server's loader
        assert len(list((tmp_path / f"hf-{name}").glob("*.safetensors"))) > 1
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / f"hf-{name}").state_dict()
        served = read_checkpoint(tmp_path / f"hf-{name}")
        for k in got:
            assert reloaded[k].dtype == torch.float32 and torch.equal(reloaded[k], got[k]), (name, k)
            assert torch.equal(served[k], got[k]), (name, k)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    sys.path.insert(0, str(REPO))
    worker(Path(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")], sys.argv[4])
