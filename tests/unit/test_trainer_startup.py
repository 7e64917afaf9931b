"""The trainer's start-up does no work it does not need: building the engine (AdamW under ZeRO) and
its first step compile nothing. DeepSpeed imports its Muon optimizer on the way (its ZeRO support
check, each gradient reduction), a module that `torch.compile`s its kernels as it is imported (torch's
inductor: ~1 CPU-s on every trainer start); the trainer imports it with the kernels left eager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BUILD_AND_STEP = """
import json, sys
import torch
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings

engine = TrainEngine(TrainerSettings(model_path=sys.argv[1], output_dir=sys.argv[2]))
batch = {"input_ids": torch.randint(0, 40, (4, 16)), "attention_mask": torch.ones(4, 16, dtype=torch.long)}
before = {n: p.detach().clone() for n, p in engine.engine.module.named_parameters()}
stats, norms = engine.train_batch([[batch]], lambda logits, mb: (logits.float().pow(2).mean(), {}))
moved = any(not torch.equal(before[n], p.detach()) for n, p in engine.engine.module.named_parameters())
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
print(json.dumps({"compiled": "torch._inductor.compile_fx" in sys.modules, "trained": moved and norms[0] > 0,
                  "muon_class": MuonWithAuxAdam.__name__}))
"""


def test_the_engine_and_its_first_step_compile_nothing(tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-c", BUILD_AND_STEP, str(tiny_model), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # DeepSpeed's Muon module is there (it compares each optimizer against its class), compiled nowhere
    assert result == {"compiled": False, "trained": True, "muon_class": "MuonWithAuxAdam"}
