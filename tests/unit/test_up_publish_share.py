"""The run summary of `jetrl up` says what publishing the weights cost the trainer: its share of all
step time (gathering the weights plus waiting on the publish) and the per-step medians."""

from __future__ import annotations

from services.up.report import summary_lines


def test_summary_prints_the_share_of_step_time_spent_publishing() -> None:
    steps = [
        {"step": 1, "version": 1, "reward_mean": 0.1, "step_time_s": 0.2, "publish_time_s": 0.01, "weights_gather_s": 0.01},
        {"step": 2, "version": 2, "reward_mean": 0.2, "step_time_s": 0.2, "publish_time_s": 0.0, "weights_gather_s": 0.002},
        {"step": 3, "version": 3, "reward_mean": 0.2, "step_time_s": 0.1, "publish_time_s": 0.2, "weights_gather_s": 0.003},
    ]
    lines = summary_lines(steps, {}, 10.0)
    # (0.015 gathering + 0.21 waiting) / 0.5 s of steps
    assert "publishing weights: 45.0% of step time (per step, median: gather 3.0 ms, publish 10.0 ms, step 200 ms)" in lines


def test_no_publish_line_without_step_timings() -> None:
    lines = summary_lines([{"step": 1, "version": 1, "reward_mean": 0.5}], {}, 1.0)
    assert not any(line.startswith("publishing weights") for line in lines)
