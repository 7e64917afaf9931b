"""One trainer update on the real model (SmolLM2-135M-Instruct): its time and peak memory by torch
threads, micro-batch token budget and gradient checkpointing.

    python bench/trainer_real.py [--model smollm2-135m-instruct] [--samples 16] [--tokens 100] [--steps 3]
                                 [--rows t1,t2,t1/mb512,t1/gc] [--full]

A row is `/`-joined parts: `tN` torch threads (default 1), `mbN` the trainer's
`max_tokens_per_microbatch` (default 0: the whole batch in one pass), `gc` gradient checkpointing.
Each row runs in its own process: the trainer's own TrainEngine + PPOActor (one CPU rank, LoRA r16
unless `--full`, `logp_chunk_tokens` 1024 with the fused output projection, the default decoupled
PPO update), `--steps` updates on one batch of `--samples` rows of `--tokens` tokens (a quarter
prompt, random ids), the first a warm-up (it allocates the optimizer states). Reported: wall-clock
and CPU seconds per update (median of the rest; on a shared machine the wall clock follows the load,
CPU time much less), the process's resident size before the last update and its peak during it
(VmHWM, reset before it), after `malloc_trim` as the trainer does after each step. Prints a table,
then a JSON line whose `score` is the first row's peak over the lowest peak among the rows within
10% of the first row's CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GIB = 2**30


def parse_row(row: str) -> dict[str, int]:
    out = {"threads": 1, "budget": 0, "gc": 0}
    for part in row.split("/"):
        if part == "gc":
            out["gc"] = 1
        elif part.startswith("mb") and part[2:].isdigit():
            out["budget"] = int(part[2:])
        elif part.startswith("t") and part[1:].isdigit():
            out["threads"] = int(part[1:])
        else:
            raise SystemExit(f"row {row!r}: unknown part {part!r} (tN, mbN or gc)")
    return out


def worker(model: str, row: dict[str, int], samples: int, tokens: int, steps: int, full: bool, result: str) -> None:
    import numpy as np
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(row["threads"])
    from services.common.model_path import resolve_model_path
    from services.trainer.intake.batch import collate, shard
    from services.trainer.model import memory
    from services.trainer.model.actor import PPOActor
    from services.trainer.model.engine import TrainEngine
    from services.trainer.model.ppo import attach_advantages
    from services.trainer.settings import TrainerSettings

    path = resolve_model_path(model)
    extra: dict[str, Any] = {} if full else {"lora": {"enabled": True, "rank": 16, "alpha": 32}}
    s = TrainerSettings.model_validate({"model_path": path, "logp_chunk_tokens": 1024, "max_tokens_per_microbatch": row["budget"],
                                        "gradient_checkpointing": bool(row["gc"]), **extra})
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    vocab = int(AutoConfig.from_pretrained(path).vocab_size)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, size=(samples, tokens))
    lm = np.zeros_like(ids)
    lm[:, tokens // 4:] = 1
    group: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": lm,
                                    "logprobs": (-2.3 * lm).astype(np.float32), "versions": np.where(lm > 0, 0, -1),
                                    "rewards": rng.random(samples).astype(np.float32)}
    b = attach_advantages(collate([group]), "grpo", 1e-6)
    walls, cpus = [], []
    before = peak = 0
    for i in range(steps):
        if i == steps - 1:
            memory.release_freed()
            before, _ = memory.resident()  # resets the peak
        t0, c0 = time.perf_counter(), time.process_time()
        actor.ppo_update(shard(b, 1, 1)[0])
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        if i == steps - 1:
            _, peak = memory.resident()
    Path(result).write_text(json.dumps({"wall_s": statistics.median(walls[1:] or walls), "cpu_s": statistics.median(cpus[1:] or cpus),
                                        "before_gib": before / GIB, "peak_gib": peak / GIB, "walls": walls}))
    sys.stdout.flush()
    os._exit(0)


def launch(args: argparse.Namespace, row: str, tmp: Path) -> dict:
    spec = parse_row(row)
    result = tmp / f"{row.replace('/', '_')}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, __file__, "--worker", args.model, json.dumps(spec), str(args.samples), str(args.tokens),
           str(args.steps), str(int(args.full)), str(result)]
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"row {row} failed:\n{proc.stdout.decode()[-2000:]}{proc.stderr.decode()[-3000:]}")
    return {**json.loads(result.read_text()), "load_average": os.getloadavg()[0]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        m, spec, n, k, st, full, res = sys.argv[2:9]
        worker(m, json.loads(spec), int(n), int(k), int(st), bool(int(full)), res)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", default="t1,t2,t1/mb512,t1/gc")
    parser.add_argument("--full", action="store_true", help="full fine-tuning (default: LoRA r16)")
    args = parser.parse_args()
    names = args.rows.split(",")
    for name in names:
        parse_row(name)
    with tempfile.TemporaryDirectory() as tmpdir:
        rows = {name: launch(args, name, Path(tmpdir)) for name in names}
    print(f"{args.model}, {'full fine-tuning' if args.full else 'LoRA r16'}; {args.samples} samples x {args.tokens} tokens; "
          f"median of {max(args.steps - 1, 1)} update(s); {os.cpu_count()} cores, shared (load average at each row's end)")
    print(f"{'row':<12}{'wall s':>9}{'CPU s':>9}{'before GiB':>12}{'peak GiB':>10}{'load':>7}")
    for name, r in rows.items():
        print(f"{name:<12}{r['wall_s']:>9.2f}{r['cpu_s']:>9.2f}{r['before_gib']:>12.2f}{r['peak_gib']:>10.2f}{r['load_average']:>7.2f}")
    first = rows[names[0]]
    cheap = [r["peak_gib"] for r in rows.values() if r["cpu_s"] <= 1.1 * first["cpu_s"]]
    table = {n: {k: v for k, v in r.items() if k != "walls"} for n, r in rows.items()}
    print(json.dumps({"score": first["peak_gib"] / min(cheap), "rows": table}))


if __name__ == "__main__":
    main()
