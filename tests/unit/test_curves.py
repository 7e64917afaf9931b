"""The run's picture: the smoothing keeps the series' length and level, and a run's metrics draw."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from services.up.curves import plot_curves, smooth


def test_smoothing_keeps_length_and_level_and_damps_noise() -> None:
    rng = np.random.default_rng(0)
    noisy = 0.5 + rng.normal(0, 0.2, 300)
    out = smooth(noisy)
    assert out.shape == noisy.shape
    assert abs(out.mean() - noisy.mean()) < 0.01
    assert out.std() < noisy.std() / 2
    ramp = np.linspace(0, 1, 50)
    assert np.allclose(smooth(ramp)[10:-10], ramp[10:-10])  # a trend is not lagged
    assert smooth(np.array([0.3])).tolist() == [0.3]


def test_a_run_draws_every_panel(tmp_path: Path) -> None:
    steps = [{"step": i, "time": 2.0 * i, "reward_mean": min(1.0, i / 50), "accuracy": i / 100, "staleness_1": 16.0,
              "staleness_max": 1.0, "data_wait_fraction": 0.1 * (i % 2), "step_time_s": 0.3, "train_time_s": 0.1,
              "publish_time_s": 0.05, "tokens_per_s": 9000.0, "samples": 128.0} for i in range(1, 80)]
    evals = [{"step": i, "time": 2.0 * i, "eval_reward_mean": i / 80} for i in range(10, 80, 10)]
    png = plot_curves(tmp_path, steps, "t", evals)
    assert png is not None and png.stat().st_size > 20_000
    assert plot_curves(tmp_path, [], "t") is None


def test_workflow_scalars_draw_one_curve_each(tmp_path: Path) -> None:
    from services.up.curves import plot_workflow_stats, workflow_series

    stats = [{"time": 2.0 * i, "worker": "w0", "rollout/reward": i / 40, "rollout/num_turns": 1 + i % 2} for i in range(40, 0, -1)]
    curves = workflow_series(stats)
    assert sorted(curves) == ["rollout/num_turns", "rollout/reward"]  # the worker is not a scalar
    times, rewards = curves["rollout/reward"]
    assert times.tolist() == [2.0 * i for i in range(1, 41)] and rewards[-1] == 1.0  # in time order
    png = plot_workflow_stats(tmp_path, stats)
    assert png == tmp_path / "workflow_stats.png" and png.stat().st_size > 10_000
    assert plot_workflow_stats(tmp_path / "none", [{"time": 1.0, "worker": "w0"}]) is None
