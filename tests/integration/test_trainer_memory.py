"""The optimizer step's memory on a real DeepSpeed ZeRO-2 engine: what the step adds on top of the
weights, the Adam states and the accumulated gradients is about one flat gradient (ZeRO's fp32
partition of it): not DeepSpeed's float64 copy of each gradient for the norm (twice a float32
gradient; the step added 2.0 gradients with it), nor AdamW's partition-sized temporaries.

The file doubles as the worker script (`python test_trainer_memory.py --worker MODEL OUT`): a process
of its own, so its resident high-water mark is the step's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _hwm_and_rss() -> tuple[int, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmHWM"], fields["VmRSS"]


def worker(model_path: str, out: Path) -> None:
    import torch

    from services.trainer.model.engine import TrainEngine
    from services.trainer.settings import TrainerSettings

    engine = TrainEngine(TrainerSettings(model_path=model_path, zero_stage=2, seed=0))
    ds = engine.engine
    grad_bytes = sum(p.numel() * 4 for p in ds.module.parameters())
    ids = torch.randint(1, 1000, (2, 16))
    added = []
    for _ in range(2):  # the first step allocates the Adam states; the second is measured
        ds.backward(ds(input_ids=ids).logits.float().log_softmax(-1).mean())
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        _, before = _hwm_and_rss()
        ds.step()
        hwm, _ = _hwm_and_rss()
        added.append(hwm - before)
    out.write_text(json.dumps({"step_added": added[-1], "grad_bytes": grad_bytes}))
    sys.stdout.flush()
    os._exit(0)


def test_optimizer_step_adds_about_one_gradient(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # A vocabulary-heavy model as real ones are: the (vocabulary x hidden) embedding is most of it.
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=200_000, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=256, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model", safe_serialization=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    result = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, __file__, "--worker", str(tmp_path / "model"), str(result)], env=env,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    r = json.loads(result.read_text())
    # ZeRO's flat fp32 gradient partition is one gradient (measured 1.0); the float64 norm copy of
    # the embedding's gradient alone is two.
    assert r["step_added"] < 1.6 * r["grad_bytes"], r


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]))
