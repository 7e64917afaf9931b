"""The jetrl side of bench/vs_trl.py: one `jetrl up` run (`python -m services.up`), its settings given as
a `--config` file, its process tree sampled for CPU-seconds and peak resident size, read back from the
run's metrics.json.

copy3: the demo's preset (services/up/presets.py) is written into the config in full, since `jetrl up`
applies it only when no `dataset_path` is given and the bench gives the copy3 prompts as a file (the
same bytes TRL reads), with the sweep's own values over it. arith: examples/smollm2_arith.yaml with the
sweep's values over it.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.support.proc_cpu import TreeCPU
from services.common.settings import deep_merge

ROOT = Path(__file__).resolve().parents[2]


def cpu_since(before: resource.struct_rusage) -> float:
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_up(name: str, sections: dict[str, Any], work: Path, args: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`jetrl up --config <sections> run=<name> run_dir=<work> display=lines *args` (each new eval round's line
    printed as it comes); returns metrics.json
    and what the bench measured around it (wall, CPU, per-process CPU and peak RSS, launch offset)."""
    cfg = work / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(sections))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    launched = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.up", "--config", str(cfg), f"run={name}", f"run_dir={work}", "display=lines", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    shown = ""
    with TreeCPU(proc.pid) as tree:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            round_ = eval_round(line)
            if round_ and round_ != shown:  # progress of a long run: a line as each eval round comes in
                shown = round_
                print(f"    jetrl {line.strip()}", flush=True)
        proc.wait()
    stdout = "".join(lines)
    measured: dict[str, Any] = {"wall_s": time.time() - launched, "cpu_s": cpu_since(before), "tree": tree}
    metrics_path = work / name / "metrics.json"
    if not metrics_path.exists():
        raise RuntimeError(f"jetrl {name} wrote no metrics (exit {proc.returncode}):\n{stdout[-3000:]}")
    metrics = json.loads(metrics_path.read_text())
    measured["offset"] = metrics.get("started_at", launched) - launched  # the command's start to up's own clock
    return metrics, measured


def eval_round(line: str) -> str:
    """The eval round a step line of `display=lines` shows ("eval@<step>"), "" where none."""
    return "eval@" + line.rsplit("| eval@", 1)[1].split()[0] if "| eval@" in line else ""


def step_split(history: list[dict[str, Any]], until_step: int | None) -> dict[str, float]:
    """Seconds of the steps up to `until_step` (all if None), summed: waiting for data, training,
    publishing weights, and the rest of the step (the loop's own work: metrics, checkpoints)."""
    timed = [s for s in history if "step_time_s" in s and (until_step is None or s["step"] <= until_step)]
    wait = sum(s.get("data_wait_fraction", 0.0) * s["step_time_s"] for s in timed)
    train = sum(s.get("train_time_s", 0.0) for s in timed)
    publish = sum(s.get("publish_time_s", 0.0) for s in timed)
    total = sum(s["step_time_s"] for s in timed)
    return {"steps": len(timed), "wait_s": wait, "train_s": train, "publish_s": publish, "other_s": total - wait - train - publish,
            "step_s_median": statistics.median(s["step_time_s"] for s in timed) if timed else float("nan")}


def copy3_sections(preset: dict[str, dict[str, Any]], setting: dict[str, Any], seed: int) -> dict[str, Any]:
    trainer = {"seed": seed, "batch_groups": setting["batch"], "eta": setting["eta"], "lr": setting["lr"]}
    return {"rollout": preset["rollout"], "trainer": deep_merge(preset["trainer"], trainer), "up": up_section(setting)}


def arith_sections(setting: dict[str, Any], seed: int, steps: int) -> dict[str, Any]:
    base = yaml.safe_load((ROOT / "examples" / "smollm2_arith.yaml").read_text())
    trainer = {"seed": seed, "batch_groups": setting["batch"], "eta": setting["eta"], "lr": setting["lr"]}
    over = {"up": {"total_steps": steps, **up_section(setting)}, "trainer": trainer}
    return deep_merge(base, over)


def up_section(setting: dict[str, Any]) -> dict[str, Any]:
    """The sweep's process layout: `up.pin_trainer`, and `up.beside_trainer` where the sweep sets it."""
    return {"pin_trainer": bool(setting.get("pin", True)),
            **({"beside_trainer": list(setting["beside"])} if setting.get("beside") is not None else {})}
