"""The run's picture (`reward_curve.png`, drawn by `jetrl up` at the end and by `jetrl plot`): six
panels a researcher reads at a glance. Every noisy per-step series is drawn raw and faint, with a
centred moving average over it; eval rounds are points."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from schemas import metric_names as names
from services.up.monitor import ACCURACY_KEYS, REWARD_KEYS, WAIT_KEYS, pick, staleness_mean

SMOOTH_STEPS = 15
"""Width of the centred moving average, in trainer steps (fewer at the ends and in short runs)."""


def smooth(ys: np.ndarray, width: int = SMOOTH_STEPS) -> np.ndarray:
    """Centred moving average that keeps the length and does not sag at the ends."""
    width = max(1, min(width, len(ys) // 3 or 1))
    if width == 1:
        return ys.astype(float)
    kernel = np.ones(width)
    sums = np.convolve(ys, kernel, mode="same")
    counts = np.convolve(np.ones_like(ys, dtype=float), kernel, mode="same")
    return sums / counts


def series(steps: list[dict[str, Any]], get: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step, wall seconds, value) of the steps where `get(step_dict)` has a value."""
    rows = [(s["step"], s.get("time", 0.0), v) for s in steps if (v := get(s)) is not None]
    if not rows:
        return np.array([]), np.array([]), np.array([])
    arr = np.array(rows, dtype=float)
    return arr[:, 0], arr[:, 1], arr[:, 2]


def _line(ax: Any, xs: np.ndarray, ys: np.ndarray, label: str, color: str) -> None:
    if len(xs) == 0:
        return
    ax.plot(xs, ys, color=color, alpha=0.25, lw=0.8)
    ax.plot(xs, smooth(ys), color=color, lw=1.8, label=label)


def plot_curves(run_dir: Path, steps: list[dict[str, Any]], title: str = "", evals: list[dict[str, Any]] | None = None) -> Path | None:
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    (ax_reward, ax_wall, ax_rate), (ax_stale, ax_idle, ax_time) = axes
    xs, ts, reward = series(steps, lambda s: pick(s, REWARD_KEYS))
    _line(ax_reward, xs, reward, "reward mean", "tab:blue")
    _line(ax_reward, *series(steps, lambda s: pick(s, ACCURACY_KEYS))[::2], "accuracy", "tab:green")
    points = [e for e in evals or [] if names.EVAL_REWARD_MEAN in e]
    if points:
        ax_reward.plot([e["step"] for e in points], [e[names.EVAL_REWARD_MEAN] for e in points], "o", ms=4,
                       color="tab:purple", label="eval reward")
    ax_reward.set(title="reward", xlabel="trainer step", ylim=(-0.02, 1.02))

    unit, per = ("minutes", 60.0) if len(ts) and ts.max() > 180 else ("seconds", 1.0)
    if len(ts):
        _line(ax_wall, ts / per, reward, "reward mean", "tab:blue")
        if points and "time" in points[0]:
            ax_wall.plot([e["time"] / per for e in points], [e[names.EVAL_REWARD_MEAN] for e in points], "o", ms=4,
                         color="tab:purple", label="eval reward")
    ax_wall.set(title="reward against wall time", xlabel=f"{unit} since start", ylim=(-0.02, 1.02))

    _line(ax_rate, *series(steps, lambda s: s.get(names.TOKENS_PER_S))[::2], "train tokens/s", "tab:brown")
    samples = series(steps, lambda s: s[names.SAMPLES] / s[names.STEP_TIME_S]
                     if s.get(names.STEP_TIME_S) and names.SAMPLES in s else None)
    ax_samples = ax_rate.twinx()
    _line(ax_samples, samples[0], samples[2], "samples/s (pipeline)", "tab:cyan")
    ax_samples.set_ylabel("samples/s")
    ax_samples.legend(loc="upper left", fontsize=8)
    ax_rate.set(title="throughput", xlabel="trainer step", ylabel="tokens/s")

    _line(ax_stale, *series(steps, staleness_mean)[::2], "mean", "tab:orange")
    sx, _, smax = series(steps, lambda s: s.get(names.STALENESS_MAX))
    if len(sx):
        ax_stale.step(sx, smax, where="mid", color="tab:red", alpha=0.4, lw=0.8, label="max")
    ax_stale.set(title="staleness of trained groups (versions)", xlabel="trainer step")

    _line(ax_idle, *series(steps, lambda s: pick(s, WAIT_KEYS))[::2], "trainer waiting for data", "tab:red")
    ax_idle.set(title="trainer idle (fraction of each step)", xlabel="trainer step", ylim=(-0.02, 1.02))

    parts = [(names.DATA_WAIT_FRACTION, "waiting for data", "tab:red"), (names.TRAIN_TIME_S, "training", "tab:blue"),
             (names.PUBLISH_TIME_S, "publishing weights", "tab:olive")]
    stack_x, stack_y, labels, colors = None, [], [], []
    for key, label, color in parts:
        if key == names.DATA_WAIT_FRACTION:
            px, _, py = series(steps, lambda s, k=key: s[k] * s[names.STEP_TIME_S] if k in s and names.STEP_TIME_S in s else None)
        else:
            px, _, py = series(steps, lambda s, k=key: s.get(k))
        if len(px) and (stack_x is None or len(px) == len(stack_x)):
            stack_x = px
            stack_y.append(smooth(py))
            labels.append(label)
            colors.append(color)
    if stack_x is not None:
        ax_time.stackplot(stack_x, *stack_y, labels=labels, colors=colors, alpha=0.7)
    ax_time.set(title="where a step's time goes (smoothed)", xlabel="trainer step", ylabel="seconds")

    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    fig.suptitle(title or f"jetrl run {run_dir.name}")
    fig.tight_layout()
    path = run_dir / "reward_curve.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def workflow_series(stats: list[dict[str, Any]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each workflow scalar (`<scope>/<name>`, AReaL's `stats_tracker`) as (seconds since start,
    value), one point per rollout metrics event that carried it, in time order."""
    out: dict[str, list[tuple[float, float]]] = {}
    for event in sorted(stats, key=lambda e: e.get("time", 0.0)):
        for key, value in event.items():
            if "/" in key and isinstance(value, int | float):
                out.setdefault(key, []).append((float(event.get("time", 0.0)), float(value)))
    return {k: (np.array([t for t, _ in v]), np.array([y for _, y in v])) for k, v in sorted(out.items())}


def plot_workflow_stats(run_dir: Path, stats: list[dict[str, Any]], title: str = "") -> Path | None:
    """`<run_dir>/workflow_stats.png`: one panel per workflow scalar against wall time (raw and
    smoothed); None when the workflow recorded none."""
    curves = workflow_series(stats)
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(curves))
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    longest = max(float(ts.max()) for ts, _ in curves.values())
    unit, per = ("minutes", 60.0) if longest > 180 else ("seconds", 1.0)
    for ax, (key, (ts, ys)) in zip(axes.flat, curves.items(), strict=False):
        _line(ax, ts / per, ys, key, "tab:blue")
        ax.set(title=key, xlabel=f"{unit} since start")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(curves):]:
        ax.set_visible(False)
    fig.suptitle(title or f"workflow statistics of {run_dir.name}")
    fig.tight_layout()
    path = run_dir / "workflow_stats.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
