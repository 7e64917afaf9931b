"""jetrl against TRL's GRPOTrainer on the same machine, model, prompts, reward and hyperparameters.

Both learn copy3 (the prompt `123=` asks for `123`; reward = fraction of digits right) from the same
byte-identical tiny model (`jetrl make-model`), one after the other in this run, each seed in its own
process, and each stops when its 10-step mean reward reaches `--target` (or at `--steps`). Printed per
run: time to a 10-step mean of 0.5 and of the target from the command's start (imports, model load and
the stack's start-up count), the step where it got there, samples generated, CPU-seconds of the whole
process tree, and for jetrl the median step broken into waiting for data, training and publishing.

    python bench/vs_trl.py                    # 3 seeds each; jetrl at its default eta and at eta 0,1,2,4
    python bench/vs_trl.py --seeds 1 --etas 4 # one run each

TRL comes from the optional extra `.[peer]` (`pip install "trl>=1.16"`). `score` = TRL's median
time-to-target / jetrl's (default settings), >= 1.0 when jetrl gets there no later than TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.support.proc_cpu import TreeCPU  # noqa: E402  (after the sys.path line)
from services.up.presets import DEMO_PRESET  # noqa: E402

# jetrl's demo defaults, given to TRL as they are (jetrl runs with its defaults, stated below)
PROMPTS_PER_STEP = DEMO_PRESET["trainer"]["batch_groups"]
GROUP = DEMO_PRESET["rollout"]["group_size"]
LR = DEMO_PRESET["trainer"]["lr"]
NEW_TOKENS = DEMO_PRESET["rollout"]["max_new_tokens"]
TEMPERATURE = DEMO_PRESET["rollout"]["temperature"]
CLIP = 0.2
ENTROPY = 0.03

# Every setting of the comparison, as each side spells it.
MAPPING = [
    ("prompts per step", f"trainer.batch_groups={PROMPTS_PER_STEP}", f"per_device_train_batch_size={PROMPTS_PER_STEP * GROUP} (samples)"),
    ("samples per prompt", f"rollout.group_size={GROUP}", f"num_generations={GROUP}"),
    ("learning rate", f"trainer.lr={LR}", f"learning_rate={LR} (constant, no warmup)"),
    ("optimizer", "torch AdamW in DeepSpeed ZeRO-2 (0.9/0.999, 1e-8, wd 0)", "adamw_torch_fused (0.9/0.999, 1e-8, weight_decay=0)"),
    ("grad clip", "trainer.grad_clip=1.0", "max_grad_norm=1.0"),
    ("new tokens", f"rollout.max_new_tokens={NEW_TOKENS}", f"max_completion_length={NEW_TOKENS}"),
    ("temperature", f"rollout.temperature={TEMPERATURE}", f"temperature={TEMPERATURE}"),
    ("ratio clip", f"ppo.eps_clip={CLIP}", f"epsilon={CLIP}"),
    ("entropy bonus", f"ppo.entropy_coef={ENTROPY}", f"entropy_coef={ENTROPY}"),
    ("loss aggregation", "ppo.loss_agg=token-mean", "loss_type=dapo (token mean over the batch)"),
    ("advantages", "ppo.adv_norm=grpo: (r - mean) / (std + 1e-6)", "scale_rewards=group: (r - mean) / (std + 1e-4); std unbiased in both"),
    ("importance weight", "decoupled: proximal/behaviour (1 at eta=0), cap 5", "none (num_iterations=1: ratio 1)"),
    ("KL", "none (ppo.kl_coef=0)", "beta=0.0"),
    ("updates per batch", "ppo.n_minibatches=1", "num_iterations=1, steps_per_generation=1"),
    ("prompt", "chat template of the tiny model's tokenizer", "the same (conversational prompts)"),
    ("stop", "<eos> or 4 tokens", "<eos> or 4 tokens"),
    ("reward", "services.reward.builtin:copy3", "the same function, in process"),
]


def make_inputs(work: Path) -> tuple[Path, Path]:
    from services.common.demo_task import write_copy3_dataset
    from services.inference.make_model import build_model

    model = build_model(work / "model")
    return model, write_copy3_dataset(work / "copy3.jsonl", 4096, 0)


# ------------------------------------------------------------------------------ TRL (child process)


def trl_child(model: str, dataset: str, seed: int, steps: int, target: float, launched: float, out: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from services.common.demo_task import copy3_reward

    torch.manual_seed(seed)
    rows = [json.loads(line) for line in Path(dataset).read_text().splitlines()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows])
    tok = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float | None]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [copy3_reward(t, a) for t, a in zip(texts, answer, strict=True)]

    history: list[dict[str, float]] = []

    class Record(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any) -> None:
            if logs and "reward" in logs:
                history.append({"step": state.global_step, "reward": logs["reward"], "t": time.time() - launched})
                recent = [h["reward"] for h in history[-10:]]
                if len(recent) == 10 and sum(recent) / 10 >= target:
                    control.should_training_stop = True

    config = GRPOConfig(
        output_dir=str(Path(out).parent / f"trl-{seed}"), per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
        num_generations=GROUP, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_completion_length=NEW_TOKENS, temperature=TEMPERATURE, epsilon=CLIP,
        entropy_coef=ENTROPY, loss_type="dapo", scale_rewards="group", beta=0.0, num_iterations=1, max_steps=steps,
        logging_steps=1, save_strategy="no", report_to="none", seed=seed, use_cpu=True, bf16=False,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok,
                          callbacks=[Record()])
    trainer.train()
    Path(out).write_text(json.dumps({"history": history}))


def run_trl(model: Path, dataset: Path, seed: int, steps: int, target: float, work: Path) -> dict[str, Any]:
    out = work / f"trl-{seed}.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    launched = time.time()
    proc = subprocess.run(
        [sys.executable, __file__, "--trl-child", str(model), str(dataset), str(seed), str(steps), str(target), str(launched), str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
    )
    wall = time.time() - launched
    cpu = _cpu_since(before)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL seed {seed} failed:\n{proc.stderr[-3000:]}")
    history = json.loads(out.read_text())["history"]
    series = [(h["step"], h["reward"], h["t"]) for h in history]
    return {"side": "trl", "seed": seed, "wall_s": wall, "cpu_s": cpu, "steps": len(history),
            "samples": len(history) * PROMPTS_PER_STEP * GROUP, **_crossings(series, target)}


# ------------------------------------------------------------------------------ jetrl


def run_jetrl(model: Path, dataset: Path, seed: int, steps: int, target: float, eta: int | None, work: Path) -> dict[str, Any]:
    import yaml

    name = f"vs-trl-{'default' if eta is None else f'eta{eta}'}-{seed}"
    trainer: dict[str, Any] = {"seed": seed}
    if eta is not None:
        trainer["eta"] = eta
    cfg = work / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"trainer": trainer}))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    launched = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.up", "--config", str(cfg), f"run={name}", f"run_dir={work}", f"model_path={model}",
         f"dataset_path={dataset}", f"total_steps={steps}", f"stop_at_reward={target}", "display=none"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    with TreeCPU(proc.pid) as tree:
        stdout, _ = proc.communicate()
    wall = time.time() - launched
    cpu = _cpu_since(before)
    metrics_path = work / name / "metrics.json"
    if not metrics_path.exists():
        raise RuntimeError(f"jetrl {name} wrote no metrics (exit {proc.returncode}):\n{stdout[-3000:]}")
    metrics = json.loads(metrics_path.read_text())
    history = metrics["steps"]
    offset = metrics.get("started_at", launched) - launched
    series = [(s["step"], s["reward_mean"], s["time"] + offset) for s in history]
    last = history[-1] if history else {}
    generated = sum(last.get(f"total_{k}", 0.0) for k in ("accepted", "stale", "filtered", "duplicate", "malformed")) * GROUP
    med = lambda key: statistics.median(s[key] for s in history if key in s) if history else float("nan")  # noqa: E731
    step_s = med("step_time_s")
    first = history[0]["time"] + offset if history else None  # the first step done, from the command's start
    at_first = tree.by_label(until_s=first) if first is not None else {}
    return {"side": "jetrl", "eta": "default" if eta is None else eta, "seed": seed, "wall_s": wall, "cpu_s": cpu,
            "cpu_startup": at_first, "cpu_total": tree.by_label(),
            "steps": len(history), "samples": generated, "stale_groups": last.get("total_stale", 0.0),
            "trained_groups": last.get("total_accepted", 0.0), "outcome": metrics.get("outcome"), "startup_s": first,
            "step_s": step_s, "wait_s": med("data_wait_fraction") * step_s, "train_s": med("train_time_s"),
            "publish_s": med("publish_time_s"), **_crossings(series, target)}


# ------------------------------------------------------------------------------ shared


def _cpu_since(before: resource.struct_rusage) -> float:
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _crossings(series: list[tuple[int, float, float]], target: float) -> dict[str, Any]:
    """Time and step where the 10-step mean reward first reaches 0.5 and `target` (None: never)."""
    out: dict[str, Any] = {"t_half": None, "t_target": None, "step_target": None, "final_10": None}
    rewards = [r for _, r, _ in series]
    for i in range(9, len(series)):
        mean = sum(rewards[i - 9 : i + 1]) / 10
        out["final_10"] = mean
        if out["t_half"] is None and mean >= 0.5:
            out["t_half"] = series[i][2]
        if out["t_target"] is None and mean >= target:
            out["t_target"], out["step_target"] = series[i][2], series[i][0]
    return out


def _median_time(runs: list[dict[str, Any]]) -> float:
    """Median time-to-target over seeds; a run that never got there counts as infinitely slow."""
    return statistics.median(r["t_target"] if r["t_target"] is not None else float("inf") for r in runs)


def _fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if value == float("inf") else format(value, spec)
    return str(value)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-child":
        a = sys.argv[2:]
        trl_child(a[0], a[1], int(a[2]), int(a[3]), float(a[4]), float(a[5]), a[6])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="step budget of every run")
    parser.add_argument("--target", type=float, default=0.9, help="10-step mean reward to reach")
    parser.add_argument("--etas", default="0,1,2,4", help="jetrl's eta sweep beside its default ('' to skip)")
    parser.add_argument("--skip-trl", action="store_true")
    args = parser.parse_args()

    print(f"{'setting':<20} {'jetrl':<52} TRL GRPOTrainer")
    for what, ours, theirs in MAPPING:
        print(f"{what:<20} {ours:<52} {theirs}")
    print(f"CPU: {os.cpu_count()} cores; jetrl: one thread per process (OMP_NUM_THREADS=1); TRL: one process, torch's default threads")

    work = Path(tempfile.mkdtemp(prefix="jetrl-vs-trl-"))
    model, dataset = make_inputs(work)
    seeds = range(args.seeds)
    trl = [] if args.skip_trl else [run_trl(model, dataset, s, args.steps, args.target, work) for s in seeds]
    jetrl = [run_jetrl(model, dataset, s, args.steps, args.target, None, work) for s in seeds]
    sweep: dict[int, list[dict[str, Any]]] = {}
    for eta in [int(e) for e in args.etas.split(",") if e.strip()]:
        sweep[eta] = [run_jetrl(model, dataset, s, args.steps, args.target, eta, work) for s in seeds]

    t_to = f"t->{args.target} s"
    header = f"{'run':<18} {'seed':>4} {'t->0.5 s':>9} {t_to:>9} {'step':>5} {'steps':>5} {'samples':>8} {'cpu s':>7}"
    print("\n" + header + f" {'stale':>6} {'start s':>7} {'step s':>7} {'wait':>6} {'train':>6} {'publish':>7}")
    for r in trl + jetrl + [r for runs in sweep.values() for r in runs]:
        name = "trl" if r["side"] == "trl" else f"jetrl eta={r['eta']}"
        line = (f"{name:<18} {r['seed']:>4} {_fmt(r['t_half']):>9} {_fmt(r['t_target']):>9} {_fmt(r['step_target']):>5} "
                f"{r['steps']:>5} {int(r['samples']):>8} {r['cpu_s']:>7.0f}")
        if r["side"] == "jetrl":
            line += (f" {int(r['stale_groups']):>6} {_fmt(r['startup_s']):>7} {r['step_s']:>7.3f} {r['wait_s']:>6.3f}"
                     f" {r['train_s']:>6.3f} {r['publish_s']:>7.3f}")
        print(line)

    cpu_split = print_cpu_split(jetrl) if jetrl else {}

    t_trl = _median_time(trl) if trl else float("nan")
    t_jetrl = _median_time(jetrl)
    score = t_trl / t_jetrl if trl and t_jetrl not in (0, float("inf")) else 0.0
    print(f"\nmedian time to {args.target}: TRL {_fmt(t_trl)} s, jetrl (defaults) {_fmt(t_jetrl)} s; score = TRL / jetrl = {score:.2f}")
    figures: dict[str, Any] = {
        "score": round(score, 3), "trl_t_target_median_s": t_trl, "jetrl_t_target_median_s": t_jetrl,
        "jetrl_eta_sweep_t_target_median_s": {str(e): _median_time(runs) for e, runs in sweep.items()},
        "trl_steps_to_target": [r["step_target"] for r in trl], "jetrl_steps_to_target": [r["step_target"] for r in jetrl],
        "jetrl_eta_sweep_steps_to_target": {str(e): [r["step_target"] for r in runs] for e, runs in sweep.items()},
        "jetrl_startup_s": [r["startup_s"] for r in jetrl], "jetrl_cpu_by_process": cpu_split,
    }
    print(json.dumps(_finite(figures)))


def print_cpu_split(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Where jetrl's CPU goes, per service (median over seeds): before the first step, and per 1000
    samples generated after it (TRL's whole run is one process: its total is in the table above)."""
    labels = sorted({k for r in runs for k in r["cpu_total"]}, key=lambda k: -statistics.median(r["cpu_total"].get(k, 0.0) for r in runs))
    print(f"\njetrl CPU-seconds by process (median of {len(runs)} default runs)")
    print(f"{'process':<14} {'start-up':>9} {'per 1k samples':>15} {'whole run':>10}")
    split: dict[str, dict[str, float]] = {}
    for k in labels:
        start = statistics.median(r["cpu_startup"].get(k, 0.0) for r in runs)
        total = statistics.median(r["cpu_total"].get(k, 0.0) for r in runs)
        per_k = statistics.median(1000 * (r["cpu_total"].get(k, 0.0) - r["cpu_startup"].get(k, 0.0)) / max(r["samples"], 1) for r in runs)
        print(f"{k:<14} {start:>9.1f} {per_k:>15.2f} {total:>10.1f}")
        split[k] = {"startup_s": round(start, 2), "per_1k_samples_s": round(per_k, 3), "whole_run_s": round(total, 2)}
    return split


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: a time never reached is null."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


if __name__ == "__main__":
    main()
