"""bench/trainer_memory.py's traced paths: the trainer's own update (TrainEngine, DeepSpeed, PPOActor)
runs on fake tensors, and what the trace reports is what that code holds. Today's path holds the
whole-vocabulary float32 tensors of every token at once; the real-model path (chunked, fused, packed
micro-batches) holds far less. Each trace is the bench's own worker process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VOCAB, SAMPLES, SEQ = 8192, 4, 128


def _trace(name: str, model: str, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, str(REPO / "bench" / "trainer_memory.py"), "--trace-worker", name, model, str(SAMPLES), str(SEQ),
           str(VOCAB), "2", "uniform", "0", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(900)
def test_the_trace_sees_todays_whole_vocabulary_tensors_and_the_new_path_without_them(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from trainer_memory import build

    model = build(tmp_path / "model", 1, VOCAB)
    today = _trace("today", model, tmp_path / "today.json")
    new = _trace("new", model, tmp_path / "new.json")
    vocab_tensor = SAMPLES * SEQ * VOCAB * 4  # one float32 (tokens x vocabulary) tensor
    assert today["traced"] and today["tokens_per_s"] is None  # nothing was computed: no time to report
    # the logits and their log-softmax, at least, live at once over the whole mini-batch
    assert today["added_bytes"] >= 2 * vocab_tensor
    assert today["phase_peak_bytes"]["logp+loss"] > today["phase_peak_bytes"]["forward"]
    assert new["added_bytes"] < today["added_bytes"] - vocab_tensor
    assert new["peak_bytes"] < today["peak_bytes"]
