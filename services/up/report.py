"""The end of a run: a summary, `metrics.json` and `reward_curve.png` in the run directory. Also used
by `jetrl plot` to redraw from the METRICS stream."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.up.monitor import ACCURACY_KEYS, REWARD_KEYS, STALENESS_KEYS, WAIT_KEYS, pick


def write_metrics(run_dir: Path, steps: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> Path:
    path = run_dir / "metrics.json"
    path.write_text(json.dumps({"steps": steps, **(extra or {})}, indent=1))
    return path


def plot_curves(run_dir: Path, steps: list[dict[str, Any]], title: str = "", evals: list[dict[str, Any]] | None = None) -> Path | None:
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["step"] for s in steps]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    series = [
        (axes[0], REWARD_KEYS, "reward mean", "tab:blue"),
        (axes[0], ACCURACY_KEYS, "accuracy", "tab:green"),
        (axes[1], STALENESS_KEYS, "staleness (versions)", "tab:orange"),
        (axes[2], WAIT_KEYS, "trainer wait fraction", "tab:red"),
    ]
    for ax, keys, label, color in series:
        ys = [pick(s, keys) for s in steps]
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, color=color, lw=1.2)
    evals = [e for e in evals or [] if "eval_reward_mean" in e]
    if evals:
        eval_steps, eval_rewards = [e["step"] for e in evals], [e["eval_reward_mean"] for e in evals]
        axes[0].plot(eval_steps, eval_rewards, "o--", ms=3, lw=1, color="tab:purple", label="eval reward")
    for ax, name in zip(axes, ("reward", "staleness", "trainer idle"), strict=True):
        ax.set_xlabel("trainer step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(title or f"jetrl run {run_dir.name}")
    fig.tight_layout()
    path = run_dir / "reward_curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_lines(steps: list[dict[str, Any]], servers: dict[str, int], wall_s: float) -> list[str]:
    if not steps:
        return ["no trainer step was recorded"]
    first = [v for s in steps[:10] if (v := pick(s, REWARD_KEYS)) is not None]
    last = [v for s in steps[-10:] if (v := pick(s, REWARD_KEYS)) is not None]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    lines = [
        f"steps: {steps[-1]['step']}  final version: {steps[-1].get('version')}  wall: {wall_s:.0f} s",
        f"reward mean: first 10 steps {mean(first):.3f} -> last 10 steps {mean(last):.3f}",
    ]
    lines += waste_lines(steps)
    for server, version in sorted(servers.items()):
        lines.append(f"server {server}: weight version {version}")
    return lines


WASTED_KINDS = ("stale", "filtered", "duplicate")
"""Groups generated in full and not trained: judged stale, removed by dynamic filtering, or a repeat."""


def waste_lines(steps: list[dict[str, Any]]) -> list[str]:
    """Groups and samples generated for nothing, from the trainer's per-step counts (a group's samples
    taken as the step's samples per trained group), and the dataset rows the feeder gave up on."""
    trained = sum(s.get("groups", 0.0) for s in steps)
    wasted = {kind: sum(s.get(f"{kind}_groups", 0.0) for s in steps) for kind in WASTED_KINDS}
    samples = sum(
        sum(s.get(f"{kind}_groups", 0.0) for kind in WASTED_KINDS) * s["samples"] / s["groups"]
        for s in steps if s.get("groups")
    )
    share = f" ({100 * wasted['stale'] / trained:.1f}% of {trained:.0f} trained)" if trained else ""
    lines = [f"stale groups: {wasted['stale']:.0f}{share}  wasted samples: {samples:.0f} "
             f"({', '.join(f'{n:.0f} {kind}' for kind, n in wasted.items())} groups)"]
    last = steps[-1]
    if "feeder_dropped" in last:
        causes = [f"{k.removeprefix('feeder_dropped_')} {last[k]:.0f}" for k in sorted(last)
                  if k.startswith("feeder_dropped_") and last[k]]
        lines.append(f"dataset rows dropped: {last['feeder_dropped']:.0f}" + (f" ({', '.join(causes)})" if causes else "")
                     + f"  re-issued: {last.get('feeder_reissued', 0.0):.0f}")
    return lines
