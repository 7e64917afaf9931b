"""DeepSpeed's accelerator follows what is present (no image pins it): CPU here, where torch sees no
GPU; an explicit DS_ACCELERATOR still wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = ("import os; from services.trainer.model.engine import import_deepspeed; import_deepspeed(); "
         "from deepspeed.accelerator import get_accelerator; print(os.environ['DS_ACCELERATOR'], get_accelerator()._name)")


def _probe(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**base, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split("\n")[-2]


def test_the_accelerator_is_cpu_without_a_gpu_and_without_a_pin() -> None:
    assert _probe() == "cpu cpu"
