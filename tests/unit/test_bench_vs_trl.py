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
