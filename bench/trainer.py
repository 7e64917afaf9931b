"""Training throughput of the tiny model: DeepSpeed ZeRO-0/1/2/3 at 1 and 2 ranks (the trainer's own
TrainEngine + PPOActor; 0, no ZeRO, is what `zero_stage: auto` runs on one rank) against a plain PyTorch
AdamW loop doing the same PPO update on the same batches. `JETRL_BENCH_STAGES=0,2` runs only those stages.

    python bench/trainer.py [--steps 20] [--groups 16] [--group-size 8]

Prints a table, then a JSON line whose `score` is ZeRO-2 1-rank tokens/s divided by the plain loop's.
Each configuration runs in its own process (`torch.distributed.run`); timings exclude 3 warm-up steps.
The plain-PPO objective (no proximal recompute) is used on both sides so the ratio is engine overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
WARMUP = 3
STAGES = tuple(int(s) for s in os.environ.get("JETRL_BENCH_STAGES", "0,1,2,3").split(","))


def batches(model_path: str, n: int, groups: int, group_size: int) -> list[dict]:
    import numpy as np

    from services.trainer.intake.batch import collate
    from services.trainer.model.ppo import attach_advantages

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        gs: list[dict[str, np.ndarray]] = []
        for _ in range(groups):
            ids = rng.integers(4, 14, size=(group_size, 9))
            ids[:, 0] = 1
            lm = np.zeros_like(ids)
            lm[:, 5:] = 1
            gs.append({"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": lm,
                       "logprobs": (-2.3 * lm).astype(np.float32), "versions": np.where(lm > 0, 0, -1),
                       "rewards": rng.random(group_size).astype(np.float32)})
        out.append(attach_advantages(collate(gs), "grpo", 1e-6))
    return out


def ds_worker(stage: int, model_path: str, steps: int, groups: int, group_size: int, result: str) -> None:
    import torch.distributed as dist

    from services.trainer.intake.batch import shard
    from services.trainer.model.actor import PPOActor
    from services.trainer.model.engine import TrainEngine
    from services.trainer.settings import TrainerSettings

    s = TrainerSettings(model_path=model_path, zero_stage=stage, ppo={"decoupled": False})
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    data = batches(model_path, steps + WARMUP, groups, group_size)
    tokens = 0.0
    for i, b in enumerate(data):
        if i == WARMUP:
            dist.barrier()
            t0 = time.perf_counter()
        actor.ppo_update(shard(b, engine.world_size, 1)[engine.rank])
        if i >= WARMUP:
            tokens += float(b["attention_mask"].sum())
    dist.barrier()
    elapsed = time.perf_counter() - t0
    if engine.rank == 0:
        Path(result).write_text(json.dumps({"tokens_per_s": tokens / elapsed, "step_s": elapsed / steps}))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def plain_loop(model_path: str, steps: int, groups: int, group_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from services.trainer.model.ppo import aggregate, entropy_from_logits, logp_from_logits, ppo_token_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    tokens = 0.0
    for i, b in enumerate(batches(model_path, steps + WARMUP, groups, group_size)):
        if i == WARMUP:
            t0 = time.perf_counter()
        t = {k: torch.from_numpy(v) for k, v in b.items()}
        logits = model(input_ids=t["input_ids"].long(), attention_mask=t["attention_mask"].long()).logits
        mask = t["loss_mask"] != 0
        n = float(mask.sum())
        parts = ppo_token_loss(logp_from_logits(logits, t["input_ids"].long()), t["logprobs"], t["advantages"], mask)
        loss = aggregate(parts.pg, mask, "token-mean", n, 1) - 0.03 * aggregate(entropy_from_logits(logits), mask, "token-mean", n, 1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i >= WARMUP:
            tokens += float(b["attention_mask"].sum())
    elapsed = time.perf_counter() - t0
    return {"tokens_per_s": tokens / elapsed, "step_s": elapsed / steps}


def launch(stage: int, nproc: int, model_path: str, args: argparse.Namespace, tmp: Path) -> dict:
    from services.common.ports import free_port

    result = tmp / f"z{stage}-w{nproc}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           __file__, "--worker", str(stage), model_path, str(args.steps), str(args.groups), str(args.group_size), str(result)]
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"ZeRO-{stage} x{nproc} failed:\n{proc.stdout.decode()[-2000:]}{proc.stderr.decode()[-3000:]}")
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from services.inference.make_model import build_model

    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        model_path = str(build_model(tmp / "tiny"))
        base = plain_loop(model_path, args.steps, args.groups, args.group_size)
        rows = {(s, w): launch(s, w, model_path, args, tmp) for s in STAGES for w in (1, 2)}
    print(f"tiny model, {args.groups} groups x {args.group_size} samples per step, {args.steps} timed steps, 1 thread per rank")
    print(f"{'config':<18}{'tokens/s':>12}{'s/step':>10}{'ratio':>9}")
    print(f"{'plain AdamW loop':<18}{base['tokens_per_s']:>12.0f}{base['step_s']:>10.4f}{1.0:>9.2f}")
    figures: dict[str, float] = {"baseline_tokens_per_s": base["tokens_per_s"]}
    for (s, w), r in rows.items():
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        figures[f"zero{s}_w{w}_tokens_per_s"] = r["tokens_per_s"]
        figures[f"zero{s}_w{w}_ratio"] = ratio
        print(f"{f'ZeRO-{s} x {w} rank':<18}{r['tokens_per_s']:>12.0f}{r['step_s']:>10.4f}{ratio:>9.2f}")
    figures["score"] = figures.get("zero2_w1_ratio", float("nan"))
    print(json.dumps(figures))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        stage, model_path, steps, groups, group_size, result = sys.argv[2:8]
        ds_worker(int(stage), model_path, int(steps), int(groups), int(group_size), result)
    else:
        main()
