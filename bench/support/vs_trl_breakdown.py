"""Where each side's time to the target went, in its best setting's median run, and jetrl's CPU-seconds
and peak resident size per process (bench/vs_trl.py).

The time to the target is cut into: start-up (the command's start until the first step began: imports,
model load; for jetrl the stack's start-up too), the first step (for jetrl it includes waiting for the
first groups), the later steps (jetrl: waiting for data, training, publishing weights, the rest of the
step; TRL: generation and scoring, training) and the gaps between steps (the time no step was timed:
jetrl's loop between steps, TRL's logging and callbacks).
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.support.vs_trl_report import fmt, label, median_run


def _split(r: dict[str, Any]) -> dict[str, float]:
    hist = [h for h in r["history"] if r["step_target"] is None or h["step"] <= r["step_target"]]
    end = r["t_target"] if r["t_target"] is not None else (hist[-1]["t"] if hist else 0.0)
    if not hist:
        return {"to_target_s": end}
    if r["side"] == "trl":
        first, rest = hist[0]["step_s"], hist[1:]
        parts = {"generation_s": sum(h["gen_s"] for h in rest), "training_s": sum(h["step_s"] - h["gen_s"] for h in rest)}
        stepped = first + sum(h["step_s"] for h in rest)
    else:
        first, rest = hist[0].get("step_time_s", 0.0), [h for h in hist[1:] if "step_time_s" in h]
        parts = {"wait_for_data_s": sum(h.get("data_wait_fraction", 0.0) * h["step_time_s"] for h in rest),
                 "training_s": sum(h.get("train_time_s", 0.0) for h in rest),
                 "publishing_s": sum(h.get("publish_time_s", 0.0) for h in rest)}
        parts["rest_of_step_s"] = sum(h["step_time_s"] for h in rest) - sum(parts.values())
        stepped = first + sum(h["step_time_s"] for h in rest)
    startup = r["startup_s"] or 0.0
    return {"to_target_s": end, "startup_s": startup, "first_step_s": first, **parts, "gaps_s": end - startup - stepped,
            "steps": len(hist)}


def print_breakdown(bests: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side, runs in bests.items():
        if not runs:
            continue
        r = median_run(runs)
        split = _split(r)
        out[side] = {"setting": label(r["setting"]), "seed": r["seed"], **{k: round(v, 3) for k, v in split.items()}}
        reached = "to the target" if r["t_target"] is not None else "(target not reached: to its last step)"
        print(f"\nwhere {side}'s time went {reached}, best setting {label(r['setting'])}, median run (seed {r['seed']})")
        total = split["to_target_s"] or 1.0
        for key, value in split.items():
            if key in ("to_target_s", "steps"):
                continue
            print(f"  {key.removesuffix('_s').replace('_', ' '):<16} {value:>8.2f} s  {100 * value / total:>5.1f}%")
        print(f"  {'total':<16} {split['to_target_s']:>8.2f} s over {split.get('steps', 0)} steps")
    if "trl" in out and "jetrl" in out:
        a, b = out["jetrl"], out["trl"]
        steps_a, steps_b = a.get("steps", 0) or 1, b.get("steps", 0) or 1
        per_a = (a["to_target_s"] - a.get("startup_s", 0.0)) / steps_a
        per_b = (b["to_target_s"] - b.get("startup_s", 0.0)) / steps_b
        print(f"\njetrl - TRL: start-up {fmt(a.get('startup_s', 0.0) - b.get('startup_s', 0.0), '+.2f')} s; steps {steps_a} against "
              f"{steps_b}; seconds a step after start-up {per_a:.3f} against {per_b:.3f}")
        out["delta"] = {"startup_s": round(a.get("startup_s", 0.0) - b.get("startup_s", 0.0), 3), "steps": [steps_a, steps_b],
                        "s_per_step_after_startup": [round(per_a, 4), round(per_b, 4)]}
    return out


def print_processes(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """jetrl's CPU-seconds per process (median over the best setting's seeds): before the first step,
    per 1000 samples generated after it and the whole run; and each process's peak resident size."""
    if not runs:
        return {}
    med = statistics.median
    labels = sorted({k for r in runs for k in r["cpu_total"]}, key=lambda k: -med(r["cpu_total"].get(k, 0.0) for r in runs))
    print(f"\njetrl CPU-seconds and peak resident size by process (median of {len(runs)} runs of {label(runs[0]['setting'])})")
    print(f"{'process':<14} {'start-up':>9} {'per 1k samples':>15} {'whole run':>10} {'peak GiB':>9}")
    split: dict[str, dict[str, float]] = {}
    for k in labels:
        start = med(r["cpu_startup"].get(k, 0.0) for r in runs)
        total = med(r["cpu_total"].get(k, 0.0) for r in runs)
        per_k = med(1000 * (r["cpu_total"].get(k, 0.0) - r["cpu_startup"].get(k, 0.0)) / max(r["samples"], 1) for r in runs)
        peak = med(r["peak_rss_gib"].get(k, 0.0) for r in runs)
        print(f"{k:<14} {start:>9.1f} {per_k:>15.2f} {total:>10.1f} {peak:>9.2f}")
        split[k] = {"startup_s": round(start, 2), "per_1k_samples_s": round(per_k, 3), "whole_run_s": round(total, 2),
                    "peak_rss_gib": round(peak, 3)}
    return split
