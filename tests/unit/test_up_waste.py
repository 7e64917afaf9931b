"""The run summary of `jetrl up` says what was generated for nothing: stale groups (and their share of
the trained ones), wasted samples, and the dataset rows the feeder dropped, by cause."""

from __future__ import annotations

from services.up.report import summary_lines


def test_summary_counts_stale_groups_wasted_samples_and_dropped_rows() -> None:
    steps = [
        {"step": 1, "version": 1, "reward_mean": 0.1, "groups": 4.0, "samples": 32.0, "stale_groups": 2.0, "filtered_groups": 1.0},
        {"step": 2, "version": 2, "reward_mean": 0.2, "groups": 4.0, "samples": 32.0, "stale_groups": 0.0, "duplicate_groups": 1.0,
         "feeder_dropped": 3.0, "feeder_dropped_rejected": 2.0, "feeder_dropped_dead_letter": 1.0, "feeder_dropped_timed_out": 0.0,
         "feeder_reissued": 7.0},
    ]
    lines = summary_lines(steps, {}, 10.0)
    assert "stale groups: 2 (25.0% of 8 trained)  wasted samples: 32 (2 stale, 1 filtered, 1 duplicate groups)" in lines
    assert "dataset rows dropped: 3 (dead_letter 1, rejected 2)  re-issued: 7" in lines


def test_summary_of_a_run_without_waste() -> None:
    steps = [{"step": 1, "version": 1, "reward_mean": 0.5, "groups": 16.0, "samples": 128.0, "stale_groups": 0.0}]
    lines = summary_lines(steps, {}, 1.0)
    assert "stale groups: 0 (0.0% of 16 trained)  wasted samples: 0 (0 stale, 0 filtered, 0 duplicate groups)" in lines


def test_summary_says_how_long_the_start_up_took() -> None:
    steps = [{"step": 1, "version": 1, "reward_mean": 0.0, "time": 12.34, "groups": 16.0, "samples": 128.0},
             {"step": 2, "version": 2, "reward_mean": 0.1, "time": 12.5, "groups": 16.0, "samples": 128.0}]
    assert "start-up: first step trained 12.3 s after the start" in summary_lines(steps, {}, 20.0)
