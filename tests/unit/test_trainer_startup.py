"""The trainer's start-up does no work it does not need: building the engine (AdamW under ZeRO) does
not import DeepSpeed's Muon optimizer, whose import compiles its kernels with torch.compile (torch's
inductor and dynamo, most of a second of CPU on every trainer start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BUILD = """
import json, sys
from services.trainer.engine import TrainEngine
from services.trainer.settings import TrainerSettings

engine = TrainEngine(TrainerSettings(model_path=sys.argv[1], output_dir=sys.argv[2]))
built = engine.engine.optimizer is not None
print(json.dumps({"muon": sorted(m for m in sys.modules if m.startswith("deepspeed") and "muon" in m), "optimizer": built}))
"""


def test_building_the_engine_does_not_import_deepspeeds_muon(tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-c", BUILD, str(tiny_model), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"muon": [], "optimizer": True}
