"""bench/vs_trl.py's TRL side runs the setting the sweep names: the precision and threads in a TRL run's
spec are that run's, not the jetrl side's shape (the arith example trains jetrl in bf16; a TRL
'fp32' run once ran in bf16 because the shape was spread over its setting)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.support import vs_trl_report as report
from bench.vs_trl import trl_spec


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trl_spec_runs_the_swept_precision_and_threads_on_the_real_model_task(tmp_path: Path, dtype: str) -> None:
    shape = report.shape("arith")
    assert shape["dtype"] == "bfloat16"  # what jetrl's example trains in: the case that hid the bug
    args = argparse.Namespace(max_steps=60, lift=0.1, eval_every=10, eval_size=32, steps=500, target=0.9)
    setting = {"batch": 4, "lr": 3e-4, "dtype": dtype, "threads": 2}
    inputs = (tmp_path / "model", tmp_path / "rows.jsonl", tmp_path / "eval.jsonl")
    spec = trl_spec("arith", setting, 1, inputs, args, shape, tmp_path / "out.json")
    assert spec["dtype"] == dtype and spec["threads"] == 2
    assert (spec["batch"], spec["lr"], spec["seed"], spec["steps"]) == (4, 3e-4, 1, 60)
    assert spec["group"] == shape["group"] and spec["new_tokens"] == shape["new_tokens"]  # the shared shape is kept
    assert spec["eval"] == str(tmp_path / "eval.jsonl")


def test_trl_spec_on_copy3_defaults_to_fp32(tmp_path: Path) -> None:
    args = argparse.Namespace(max_steps=60, lift=0.1, eval_every=10, eval_size=32, steps=500, target=0.9)
    spec = trl_spec("copy3", {"batch": 16, "lr": 1e-3, "threads": 1}, 0, (tmp_path / "m", tmp_path / "d", None),
                    args, report.shape("copy3"), tmp_path / "out.json")
    assert (spec["dtype"], spec["threads"], spec["steps"], spec["target"], spec["eval"]) == ("float32", 1, 500, 0.9, None)


def test_ceiling_caps_the_score_at_what_jetrl_cpu_per_sample_allows(capsys: pytest.CaptureFixture[str]) -> None:
    """The bench's 'at most' line: jetrl's CPU-seconds per 1000 samples over the cores is the floor of a
    step; TRL's steps at that floor after jetrl's start-up is the best jetrl could do."""
    from bench.support.vs_trl_ceiling import print_ceiling

    breakdown = {"trl": {"to_target_s": 21.8, "steps": 242, "startup_s": 5.7}, "jetrl": {"to_target_s": 33.0, "startup_s": 9.0}}
    processes = {"trainer": {"per_1k_samples_s": 0.56}, "rollout": {"per_1k_samples_s": 0.23},
                 "server": {"per_1k_samples_s": 0.21}, "rest": {"per_1k_samples_s": 0.17}}
    trl_runs = [{"setting": {"batch": 16, "lr": 1e-3, "threads": 2}}]
    cap = print_ceiling(breakdown, processes, trl_runs, group=8, cores=2)
    # 1.17 CPU-s per 1000 samples x 128 samples / 2 cores = 0.0749 s a step; 9.0 + 242 x 0.0749 = 27.1 s
    assert cap["floor_step_s"] == pytest.approx(0.0749, abs=1e-4)
    assert cap["best_possible_s"] == pytest.approx(27.12, abs=0.01)
    assert cap["ceiling_score"] == pytest.approx(21.8 / 27.12, abs=1e-3)
    assert "a score of at most 0.80" in capsys.readouterr().out
    assert print_ceiling(breakdown, processes, trl_runs, group=8, cores=4)["ceiling_score"] > cap["ceiling_score"]  # more cores, higher cap
    assert print_ceiling({"jetrl": breakdown["jetrl"]}, processes, [], group=8) == {}  # no TRL side (--skip-trl): no line


def test_an_unpinned_jetrl_setting_runs_up_with_pin_trainer_off_and_says_so_in_its_label() -> None:
    from bench.support.jetrl_side import arith_sections, copy3_sections
    from services.up.presets import DEMO_PRESET

    pinned = {"batch": 32, "eta": 1, "lr": 1e-3, "pin": True}
    assert copy3_sections(DEMO_PRESET, pinned, 0)["up"] == {"pin_trainer": True}
    assert copy3_sections(DEMO_PRESET, {**pinned, "pin": False}, 0)["up"] == {"pin_trainer": False}
    assert arith_sections({**pinned, "pin": False}, 0, 60)["up"]["pin_trainer"] is False
    assert report.label(pinned) == "b32 eta1 lr0.001"  # jetrl's default
    assert report.label({**pinned, "pin": False}) == "b32 eta1 lr0.001 unpinned"


def test_a_beside_setting_runs_up_with_those_services_beside_the_trainer_and_names_a_valid_run() -> None:
    from bench.support.jetrl_side import copy3_sections
    from bench.vs_trl import BESIDE, run_name
    from services.up.presets import DEMO_PRESET
    from services.up.settings import UpSettings

    setting = {"batch": 16, "eta": 2, "lr": 1e-3, "pin": True, "beside": ["reward", "weights"]}
    up = copy3_sections(DEMO_PRESET, setting, 0)["up"]
    assert up == {"pin_trainer": True, "beside_trainer": ["reward", "weights"]}
    assert UpSettings(**up).beside_trainer == ["reward", "weights"]  # what the bench writes, jetrl up takes
    assert {"reward", "weights"} <= set(BESIDE) and "inference" not in BESIDE  # the names up.beside_trainer takes
    assert report.label(setting) == "b16 eta2 lr0.001 beside:reward+weights"
    assert report.label({**setting, "beside": []}) == "b16 eta2 lr0.001 beside:none"
    assert "beside" not in copy3_sections(DEMO_PRESET, {**setting, "beside": None}, 0)["up"]  # up's own default
    assert UpSettings(run=run_name("copy3", setting, 3)).run == "vs-trl-copy3-b16-eta2-lr0p001-beside_reward_weights-3"
