"""The issue's acceptance for AReaL's own code in the real stack: a ported piece (its imports rewritten
from docs/compat.md's map, nothing else) trains 20 steps in `jetrl up` on the tiny model with no failed
episode, and its `stats_tracker` scalars land in metrics.json. Minutes per piece, so it runs only
with JETRL_AREAL_ACCEPTANCE=1 (the normal suite runs each piece's episodes in
test_areal_port.py); `JETRL_AREAL_PIECES` picks pieces (comma-separated, default all)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.areal.areal_pkg import install
from tests.areal.port import port
from tests.areal.test_areal_port import FILES, MAX_POSITIONS, PACKAGE, PIECES, STATS
from tests.support.up import ROOT, finish, left_behind, up_env

STEPS = 20
SELECTED = [p.strip() for p in os.environ.get("JETRL_AREAL_PIECES", "").split(",") if p.strip()] or list(PIECES)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("JETRL_AREAL_ACCEPTANCE") != "1",
                       reason="the 20-step acceptance runs take minutes each: set JETRL_AREAL_ACCEPTANCE=1"),
]


def dataset(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"answer": str(i + 2), "messages": [{"role": "user", "content": f"What is {i} + 2?"}]}) + "\n"
                            for i in range(n)))
    return path


@pytest.mark.timeout(900)
@pytest.mark.parametrize("piece", SELECTED)
def test_areal_piece_trains_20_steps_in_jetrl_up(piece: str, tmp_path: Path) -> None:
    from services.inference.make_model import build_model

    dest = port(install(), FILES, tmp_path / "port", PACKAGE)
    build_model(tmp_path / "model", max_positions=MAX_POSITIONS)  # `jetrl up` uses the tiny model jetrl made there
    workflow, kwargs = PIECES[piece]
    config: dict[str, Any] = {
        "up": {"pass_env": ["PYTHONPATH"], "dataset_path": str(dataset(tmp_path / "gsm.jsonl", 400)), "stop_at_reward": 0},
        "rollout": {"workflow": workflow, "workflow_kwargs": kwargs, "group_size": 2, "max_new_tokens": 6,
                    "max_concurrent": 8, "metrics_interval_s": 1},
        "trainer": {"batch_groups": 2, "eta": 2, "checkpoint_every": 0},
    }
    (tmp_path / "up.yaml").write_text(yaml.safe_dump(config))
    env = up_env(str(dest))
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.up", "--config", str(tmp_path / "up.yaml"), "run=areal", f"run_dir={tmp_path}",
         f"total_steps={STEPS}", "display=lines", f"model_path={tmp_path / 'model'}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    out = finish(proc, timeout=840)
    assert proc.returncode == 0, out[-4000:]
    metrics = json.loads((tmp_path / "areal" / "metrics.json").read_text())
    assert metrics["steps"][-1]["step"] == STEPS, out[-3000:]
    assert metrics["rollout_outcomes"].get("episodes_failed_total", 0) == 0, metrics["rollout_outcomes"]
    assert any(STATS[piece] in s for s in metrics["workflow_stats"]), metrics["workflow_stats"][:3]
    summary = [line for line in out.splitlines() if line.startswith("workflow statistics (mean of the last 10 reports): ")]
    assert summary and f"{STATS[piece]} " in summary[-1], out[-3000:]  # the run summary names the workflow's scalars
    print(f"{piece}: {metrics['steps'][-1]['step']} steps, rollout outcomes {metrics['rollout_outcomes']}, "
          f"workflow stats {sorted({k for s in metrics['workflow_stats'] for k in s})}")
    assert not left_behind(tmp_path)
