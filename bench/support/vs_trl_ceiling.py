"""The most jetrl's measured CPU cost per sample allows against TRL's best run on this machine's cores
(bench/vs_trl.py).

A run cannot go faster than its processes' CPU-seconds spread over every core, all the time. With
jetrl's CPU-seconds per 1000 samples (after start-up, summed over its processes, median of its best
setting's runs), a step of TRL's best batch takes at least that cost over the cores; the best jetrl
could then do is its own start-up plus TRL's steps to the target at that floor: TRL's step count (as
if data one or two versions old cost no extra steps) and every core busy at every moment (as if
generation, scoring, training and the weight update overlapped perfectly). `ceiling_score` = TRL's
best median time / that time: no schedule reaches a higher score unless a sample costs less CPU.
"""

from __future__ import annotations

from typing import Any

from services.up.layout import cores as allowed_cores


def ceiling(t_trl: float, trl_steps: int, trl_batch_samples: int, jetrl_startup_s: float, cpu_per_1k: float,
            cores: int) -> dict[str, float]:
    """The floor of a step and the best possible time and score (module docstring)."""
    floor_step_s = cpu_per_1k * trl_batch_samples / 1000.0 / cores
    best_s = jetrl_startup_s + trl_steps * floor_step_s
    return {"cpu_per_1k_samples_s": round(cpu_per_1k, 3), "cores": cores, "samples_per_step": trl_batch_samples,
            "floor_step_s": round(floor_step_s, 4), "trl_steps": trl_steps, "jetrl_startup_s": round(jetrl_startup_s, 2),
            "best_possible_s": round(best_s, 2), "trl_s": round(t_trl, 2),
            "ceiling_score": round(t_trl / best_s, 3) if best_s > 0 else 0.0}


def print_ceiling(breakdown: dict[str, Any], processes: dict[str, dict[str, float]], trl_runs: list[dict[str, Any]],
                  group: int, cores: int | None = None) -> dict[str, float]:
    """Prints and returns `ceiling` for the best settings' median runs ({} when a side is missing)."""
    trl, jetrl = breakdown.get("trl"), breakdown.get("jetrl")
    if not trl or not jetrl or not processes or not trl_runs:
        return {}
    n = cores or allowed_cores()  # the cores jetrl up lays its processes out on
    out = ceiling(trl["to_target_s"], int(trl.get("steps", 0)), trl_runs[0]["setting"]["batch"] * group,
                  jetrl.get("startup_s", 0.0), sum(p["per_1k_samples_s"] for p in processes.values()), n)
    print(f"\nthe most jetrl's CPU per sample allows here: {out['cpu_per_1k_samples_s']:.2f} CPU-s per 1000 samples over "
          f"{n} cores is {out['floor_step_s']:.4f} s a {out['samples_per_step']}-sample step at the least; at TRL's "
          f"{out['trl_steps']} steps after jetrl's {out['jetrl_startup_s']:.1f} s start-up that is {out['best_possible_s']:.1f} s "
          f"against TRL's {out['trl_s']:.1f} s: a score of at most {out['ceiling_score']:.2f} (no extra steps for staleness, "
          f"every core busy all the time) unless a sample costs less CPU")
    return out
