"""Time to a 0.9 reward on copy3 for each built-in algorithm, on the whole local stack (`jetrl up`)
at the demo's default staleness budget (eta = 4), one run per algorithm, plus the one-file example.

For each: seconds and steps from the first trainer step to the first step whose 10-step mean reward
reaches the target (start-up excluded; "-" if not reached within --steps), and the final 10-step
mean. The last line is a JSON object; `score` is the fastest built-in's time over GRPO's (the
default's) time, null when either did not reach the target. There is no target for the score.

    python bench/algorithms.py                       # every algorithm, up to 300 steps each
    python bench/algorithms.py --steps 3 --only grpo,cispo   # a smoke run: it starts, trains, prints
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
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 4  # the demo's generation budget: Dr.GRPO's constant normaliser

# name -> `trainer.ppo` settings (docs/algorithms.md explains each).
ALGORITHMS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "drgrpo": {"adv_norm": "drgrpo", "loss_agg": "seq-mean-token-sum-norm", "loss_agg_norm": MAX_NEW_TOKENS},
    "rloo": {"adv_norm": "rloo"},
    "reinforce++": {"adv_norm": "reinforce++", "kl_coef": 0.001, "kl_in": "reward", "kl_estimator": "k1"},
    "gspo": {"policy_loss": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4, "loss_agg": "seq-mean-token-mean"},
    "dapo": {"eps_clip": 0.2, "eps_clip_high": 0.28, "dynamic_filtering": True, "loss_agg": "token-mean"},
    "dual-clip": {"dual_clip": 3.0},
    "grpo+kl-k3": {"kl_coef": 0.01, "kl_estimator": "k3", "kl_in": "loss"},
    "cispo (example)": {"algorithm": "examples.cispo:CISPO"},
}
BUILT_IN = [name for name in ALGORITHMS if "example" not in name]


def run_one(workdir: Path, name: str, ppo: dict[str, Any], steps: int, target: float, window: int) -> dict[str, Any]:
    run = "algo-" + "".join(c if c.isalnum() else "-" for c in name).strip("-")
    config = {"trainer": {"checkpoint_every": 0, "ppo": ppo}, "rollout": {"max_new_tokens": MAX_NEW_TOKENS}}
    cfg = workdir / f"{run}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "services.up", "--config", str(cfg), f"run={run}", f"run_dir={workdir}",
         f"total_steps={steps}", f"stop_at_reward={target}", "display=lines", f"model_path={workdir / 'model'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"jetrl up ({name}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    history = json.loads((workdir / run / "metrics.json").read_text())["steps"]
    rewards = [float(s["reward_mean"]) for s in history]
    reached = None
    for i in range(len(rewards)):
        recent = rewards[max(0, i + 1 - window) : i + 1]
        if i + 1 >= window and sum(recent) / len(recent) >= target:
            reached = i
            break
    tail = rewards[-window:]
    return {
        "steps_run": len(history),
        "seconds": history[reached]["time"] - history[0]["time"] if reached is not None else None,
        "steps": history[reached]["step"] if reached is not None else None,
        "final_reward": sum(tail) / max(len(tail), 1),
        "wall_s": time.monotonic() - started,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="most trainer steps per algorithm")
    parser.add_argument("--target", type=float, default=0.9, help="the reward to reach (10-step mean)")
    parser.add_argument("--window", type=int, default=10, help="steps in the reward mean")
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(ALGORITHMS)}")
    parser.add_argument("--workdir", default=None, help="keep the runs (metrics.json, logs) here instead of a temp dir")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(ALGORITHMS)
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        raise SystemExit(f"--only: unknown algorithm(s) {unknown}; expected some of {list(ALGORITHMS)}")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="jetrl-bench-algos-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in names:
            results[name] = run_one(workdir, name, ALGORITHMS[name], args.steps, args.target, args.window)
    print(f"time to a {args.window}-step mean reward of {args.target} on copy3 (eta 4, at most {args.steps} steps)")
    print(f"{'algorithm':<18}{'seconds':>9}{'steps':>7}{'final reward':>14}{'steps run':>11}")
    for name, r in results.items():
        print(f"{name:<18}{_fmt(r['seconds'], '.1f'):>9}{_fmt(r['steps'], 'd'):>7}{r['final_reward']:>14.3f}{r['steps_run']:>11}")
    grpo = results.get("grpo", {}).get("seconds")
    timed = {n: r["seconds"] for n, r in results.items() if n in BUILT_IN and r["seconds"] is not None}
    best = min(timed, key=lambda n: timed[n]) if timed else None
    score = round(timed[best] / grpo, 3) if best is not None and grpo else None
    print(json.dumps({
        "score": score,
        "best": best,
        "steps": args.steps,
        **{f"{n.split()[0]}_s": (round(r["seconds"], 2) if r["seconds"] is not None else None) for n, r in results.items()},
    }))


if __name__ == "__main__":
    main()
