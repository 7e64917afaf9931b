"""bench/vs_trl.py's figures and tables: each run's outcome, the sweep's table per setting, best against
best, and where jetrl's time and CPU went in its best setting."""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import yaml

from services.up.presets import DEMO_PRESET

ROOT = Path(__file__).resolve().parents[2]
INF = float("inf")


def label(setting: dict[str, Any]) -> str:
    parts = ([f"b{setting['batch']}"] + ([f"eta{setting['eta']}"] if "eta" in setting else []) + [f"lr{setting['lr']:g}"]
             + ([{"float32": "fp32", "bfloat16": "bf16"}[setting["dtype"]]] if "dtype" in setting else [])
             + ([f"t{setting['threads']}"] if "threads" in setting else []) + (["unpinned"] if setting.get("pin") is False else [])
             + ([f"beside:{beside_label(setting['beside'])}"] if setting.get("beside") is not None else []))
    return " ".join(parts)


def beside_label(beside: list[str]) -> str:
    """How a sweep's `up.beside_trainer` value is spelled (`--beside`): "none" or the services joined by "+"."""
    return "+".join(beside) or "none"


def shape(task: str) -> dict[str, Any]:
    """What both sides share, from jetrl's own preset or example config."""
    if task == "copy3":
        r = DEMO_PRESET["rollout"]
        return {"group": r["group_size"], "new_tokens": r["max_new_tokens"], "temperature": r["temperature"],
                "entropy": DEMO_PRESET["trainer"]["ppo"]["entropy_coef"], "lora": None,
                "filter": bool(DEMO_PRESET["trainer"]["ppo"].get("dynamic_filtering", False)), "dtype": "float32",
                "threads": "one thread per process (OMP_NUM_THREADS=1)"}
    from services.trainer.settings import LoRASettings

    cfg = yaml.safe_load((ROOT / "examples" / "smollm2_arith.yaml").read_text())
    r, t = cfg["rollout"], cfg["trainer"]
    lora = {"rank": t["lora"]["rank"], "alpha": t["lora"]["alpha"], "target_modules": LoRASettings().target_modules}
    return {"group": r["group_size"], "new_tokens": r["max_new_tokens"], "temperature": r["temperature"],
            "entropy": t["ppo"]["entropy_coef"], "lora": lora,
            "filter": bool(t["ppo"].get("dynamic_filtering", False)), "dtype": cfg["up"].get("dtype", "float32"),
            "threads": f"trainer and server {cfg['up'].get('torch_threads')} torch threads each (waiting passively), the rest 1"}


def print_mapping(args: argparse.Namespace, sh: dict[str, Any]) -> None:
    b, lrs, etas = ",".join(map(str, args.batches)), ",".join(f"{x:g}" for x in args.lrs), ",".join(map(str, args.etas))
    lora = sh["lora"]
    rows = [
        ("task", f"{args.task}", "the same rows, the same reward function in process"),
        ("prompts per step", f"trainer.batch_groups in {{{b}}} (swept)", f"per_device_train_batch_size = prompts x {sh['group']} (swept)"),
        ("samples per prompt", f"rollout.group_size={sh['group']}", f"num_generations={sh['group']}"),
        ("learning rate", f"trainer.lr in {{{lrs}}} (swept)", "learning_rate, the same values (constant, no warmup)"),
        ("staleness", f"trainer.eta in {{{etas}}} (swept)", "none: on-policy (generation waits for training)"),
        ("cores", "up.pin_trainer in {" + ",".join("on" if p else "off" for p in args.pins) + "} (swept; on: trainer's own cores)"
         + ("; up.beside_trainer in {" + ", ".join(beside_label(b) for b in args.beside) + "} (swept)" if args.beside else ""),
         "one process on every core"),
        ("optimizer", "torch AdamW (0.9/0.999, 1e-8, wd 0), clip 1.0", "adamw_torch_fused (0.9/0.999, 1e-8, wd 0), max_grad_norm=1.0"),
        ("new tokens", f"rollout.max_new_tokens={sh['new_tokens']}", f"max_completion_length={sh['new_tokens']}"),
        ("temperature", f"rollout.temperature={sh['temperature']}", f"temperature={sh['temperature']} (top_k 0, top_p 1)"),
        ("ratio clip / KL", "ppo.eps_clip=0.2, kl_coef=0", "epsilon=0.2, beta=0.0"),
        ("entropy bonus", f"ppo.entropy_coef={sh['entropy']}", f"entropy_coef={sh['entropy']}"),
        ("loss / advantages", "token-mean, (r - mean) / (std + 1e-6)", "loss_type=dapo, scale_rewards=group (std + 1e-4)"),
        ("equal-reward groups", f"ppo.dynamic_filtering={str(sh['filter']).lower()}" + (" (dropped, counted)" if sh["filter"] else ""),
         "kept in the batch (zero advantage: TRL has no filter)"),
        ("updates per batch", "ppo.n_minibatches=1", "num_iterations=1"),
        ("LoRA", f"r={lora['rank']} alpha={lora['alpha']} on {','.join(lora['target_modules'])}" if lora else "off (full)",
         "the same (peft LoraConfig)" if lora else "off (full)"),
        ("prompt", "the model's chat template, one user message", "the same (conversational prompts)"),
        ("precision", f"up.dtype={sh['dtype']}" + (" (trainer: fp32 master weights; server)" if sh["dtype"] != "float32" else ""),
         f"bf16 in {{{','.join('true' if d == 'bfloat16' else 'false' for d in args.trl_dtypes)}}}"
         + (" (swept; mixed precision, fp32 weights)" if len(args.trl_dtypes) > 1 else "")),
    ]
    print(f"{'setting':<20} {'jetrl':<60} TRL GRPOTrainer")
    for what, ours, theirs in rows:
        print(f"{what:<20} {ours:<60} {theirs}")
    print(f"CPU: {len(os.sched_getaffinity(0))} cores; jetrl: {sh['threads']}; TRL: one process, "
          f"{' or '.join(str(t) for t in args.trl_threads)} torch threads (OMP_NUM_THREADS, set per run"
          f"{'; swept' if len(args.trl_threads) > 1 else ''})")


def crossings(series: list[tuple[int, float, float]], target: float) -> dict[str, Any]:
    """copy3: time and step where the 10-step mean reward first reaches 0.5 and `target` (None: never)."""
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


def outcome(task: str, series: list[tuple[int, float, float]], evals: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    if task == "copy3":
        return crossings(series, args.target)
    # arith: the first eval round `lift` over the step-0 round; its time is when its step was trained
    rounds = sorted((e["step"], e["eval_accuracy"]) for e in evals if e.get("eval_accuracy") is not None)
    base = next((acc for step, acc in rounds if step == 0), None)
    out: dict[str, Any] = {"base_acc": base, "best_acc": max((a for _, a in rounds), default=None), "t_target": None,
                           "step_target": None, "t_half": None, "rounds": rounds}
    at = {step: t for step, _, t in series}
    if base is not None:
        hit = next(((s, a) for s, a in rounds if s > 0 and a >= base + args.lift - 1e-9 and s in at), None)
        if hit is not None:
            out["step_target"], out["t_target"] = hit[0], at[hit[0]]
    return out


def fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if value == INF else "nan" if value != value else format(value, spec)
    return str(value)


def print_progress(r: dict[str, Any]) -> None:
    print(f"  done: {r['side']:<5} {label(r['setting']):<18} seed {r['seed']}: to target {fmt(r['t_target'])} s at step "
          f"{fmt(r['step_target'])}, {r['steps']} steps, wall {r['wall_s']:.1f} s", flush=True)


def _t(r: dict[str, Any]) -> float:
    return r["t_target"] if r["t_target"] is not None else INF


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run at the median time (the lower middle one of an even count)."""
    ordered = sorted(runs, key=_t)
    return ordered[(len(ordered) - 1) // 2]


def _first(r: dict[str, Any]) -> float | None:
    """Seconds from the command's start until the first step ended (start-up, then the first batch: for
    jetrl its generation by the servers just started, for TRL its own generation)."""
    return r["history"][0]["t"] if r["history"] else None


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    from bench.support.vs_trl_breakdown import print_breakdown, print_processes
    from bench.support.vs_trl_ceiling import print_ceiling

    unit = "10-step mean reward " + str(args.target) if args.task == "copy3" else f"eval pass rate +{args.lift:.2f}"
    print(f"\nevery run (time to the {unit}, seconds from the command's start)")
    print(f"{'side':<6} {'setting':<18} {'seed':>4} {'t->0.5':>7} {'t->tgt':>7} {'step':>5} {'steps':>5} {'samples':>8} {'cpu s':>7} "
          f"{'start':>6} {'1st':>6} {'step s':>7} {'gen/wait':>8} {'train':>6} {'peak GiB':>8} {'eval acc':>14}")
    for r in runs:
        hist = r["history"]
        step_s = _med([h.get("step_s", h.get("step_time_s", 0.0)) for h in hist])
        gen = _med([h["gen_s"] if "gen_s" in h else h.get("data_wait_fraction", 0.0) * h.get("step_time_s", 0.0) for h in hist])
        train = _med([h["step_s"] - h["gen_s"] if "gen_s" in h else h.get("train_time_s", 0.0) for h in hist])
        peak = max(r["peak_rss_gib"].values(), default=0.0)
        acc = f"{fmt(r.get('base_acc'), '.3f')}->{fmt(r.get('best_acc'), '.3f')}" if args.task == "arith" else ""
        print(f"{r['side']:<6} {label(r['setting']):<18} {r['seed']:>4} {fmt(r['t_half']):>7} {fmt(r['t_target']):>7} "
              f"{fmt(r['step_target']):>5} {r['steps']:>5} {int(r['samples']):>8} {r['cpu_s']:>7.0f} {fmt(r['startup_s']):>6} "
              f"{fmt(_first(r)):>6} {step_s:>7.3f} {gen:>8.3f} {train:>6.3f} {peak:>8.2f} {acc:>14}")

    print(f"\nby setting (median over seeds; a run that never got there counts as inf)\n{'side':<6} {'setting':<18} "
          f"{'median t->tgt':>13} {'median step':>11} {'reached':>8} {'median start':>12} {'median 1st':>10}")
    table: dict[str, dict[str, Any]] = {}
    for side in ("trl", "jetrl"):
        for lab in dict.fromkeys(label(r["setting"]) for r in runs if r["side"] == side):
            group = [r for r in runs if r["side"] == side and label(r["setting"]) == lab]
            steps = [r["step_target"] for r in group if r["step_target"] is not None]
            row = {"median_t_s": _med([_t(r) for r in group]), "median_step": _med(steps) if steps else None,
                   "reached": f"{len(steps)}/{len(group)}", "t_s": [r["t_target"] for r in group],
                   "steps_to_target": [r["step_target"] for r in group],
                   "median_startup_s": _med([r["startup_s"] for r in group if r["startup_s"] is not None]),
                   "median_first_step_s": _med([f for f in map(_first, group) if f is not None])}
            table[f"{side} {lab}"] = row
            print(f"{side:<6} {lab:<18} {fmt(row['median_t_s']):>13} {fmt(row['median_step']):>11} {row['reached']:>8} "
                  f"{fmt(row['median_startup_s']):>12} {fmt(row['median_first_step_s']):>10}")

    best: dict[str, tuple[str, float]] = {}
    for side in ("trl", "jetrl"):
        rows = {k.split(" ", 1)[1]: v["median_t_s"] for k, v in table.items() if k.startswith(side + " ")}
        if rows:
            lab = min(rows, key=lambda k: rows[k])
            best[side] = (lab, rows[lab])
    t_trl, t_jetrl = best.get("trl", ("", INF))[1], best.get("jetrl", ("", INF))[1]
    score = t_trl / t_jetrl if "trl" in best and "jetrl" in best and 0 < t_jetrl < INF else 0.0
    print(f"\nbest against best: TRL {best.get('trl', ('-',))[0]} {fmt(t_trl)} s, jetrl {best.get('jetrl', ('-',))[0]} "
          f"{fmt(t_jetrl)} s; score = TRL / jetrl = {score:.2f}")

    bests = {side: [r for r in runs if r["side"] == side and label(r["setting"]) == best[side][0]] for side in best}
    breakdown = print_breakdown(bests)
    processes = print_processes(bests.get("jetrl", []))
    cap = print_ceiling(breakdown, processes, bests.get("trl", []), shape(args.task)["group"])
    return {"score": round(score, 3), "task": args.task, "seeds": args.seeds, "first_seed": args.first_seed,
            "batches": args.batches, "lrs": args.lrs, "etas": args.etas, "pins": args.pins, "beside": args.beside,
            "trl_best": {"setting": best.get("trl", (None,))[0], "median_t_s": t_trl},
            "jetrl_best": {"setting": best.get("jetrl", (None,))[0], "median_t_s": t_jetrl},
            "settings": table, "breakdown": breakdown, "jetrl_processes": processes,
            "ceiling": cap}


def finite(value: Any) -> Any:
    """JSON has no inf/nan: a time never reached is null."""
    if isinstance(value, float) and (value != value or value in (INF, -INF)):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
