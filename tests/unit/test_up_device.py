"""`jetrl up`'s device setting (services/up/device.py): what the trainer and the inference servers are
handed for `device: cpu` and `device: cuda`, the user's own sections winning, the settings printed at
the start (and kept for metrics.json), and `device=cuda` refused before anything starts where torch
sees no GPU. The run on a GPU is tests/gpu/test_up_cuda.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from services.up.compose import Composed, compose
from services.up.credentials import make_credentials
from services.up.layout import Layout
from services.up.run import _print_settings
from services.up.settings import UpSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_test_issuer_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read as `jetrl up`'s services read their settings: without conftest's issuer key for the other tests' trainers."""
    from services.up.credentials import ISSUER_KEY_ENV

    monkeypatch.delenv(ISSUER_KEY_ENV, raising=False)


def _compose(tmp_path: Path, sections: dict[str, dict[str, Any]], environ: dict[str, str], **up: Any) -> Composed:
    s = UpSettings(run="r", run_dir=str(tmp_path), dataset_path="d.jsonl", **up)
    creds = make_credentials(tmp_path, "r")
    return compose(s, sections, creds, tmp_path, "nats://127.0.0.1:4222", Layout(cores=2, rollout_workers=1, torch_threads=1),
                   "d.jsonl", None, environ=environ)


def _env(composed: Composed, name: str) -> dict[str, str]:
    return next(step.env for step in composed.plan if step.name == name)


def _weights(trainer_env: dict[str, str]) -> dict[str, Any]:
    """The trainer's `weights` (a union of transports, passed as JSON)."""
    return json.loads(trainer_env["JETRL_TRAINER__WEIGHTS"])


def test_device_cpu_hides_the_gpu_from_the_trainer_and_serves_float32_on_the_cpu(tmp_path: Path,
                                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    composed = _compose(tmp_path, {}, {"CUDA_VISIBLE_DEVICES": "0"})
    trainer, server = _env(composed, "trainer"), _env(composed, "inference-0")
    assert trainer["DS_ACCELERATOR"] == "cpu" and trainer["CUDA_VISIBLE_DEVICES"] == ""
    assert trainer["JETRL_TRAINER__DTYPE"] == _weights(trainer)["dtype"] == "float32"
    assert server["JETRL_INFERENCE__DEVICE"] == "cpu" and server["JETRL_INFERENCE__DTYPE"] == "float32"
    assert "JETRL_INFERENCE__MEMORY_FRACTION" not in server and "CUDA_VISIBLE_DEVICES" not in server
    used = _print_settings(UpSettings(dataset_path="d.jsonl"), composed.learning)
    printed = capsys.readouterr().out
    assert "  up: device=cpu, dtype=float32" in printed and "device=cpu, dtype=float32, max_batch_size" in printed
    assert used["up"] == {"device": "cpu", "dtype": "float32"} and used["trainer"]["dtype"] == "float32"  # metrics.json's


def test_device_cuda_puts_trainer_and_servers_on_one_gpu_in_bf16_and_the_sections_win(tmp_path: Path,
                                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    environ = {"CUDA_VISIBLE_DEVICES": "3", "LD_LIBRARY_PATH": "/opt/cuda/lib64", "SECRET": "not passed"}
    composed = _compose(tmp_path, {}, environ, device="cuda", inference_servers=2, serving_memory_fraction=0.4)
    trainer = _env(composed, "trainer")
    assert trainer["DS_ACCELERATOR"] == "cuda" and trainer["CUDA_VISIBLE_DEVICES"] == "3"
    assert trainer["LD_LIBRARY_PATH"] == "/opt/cuda/lib64" and "SECRET" not in trainer
    assert trainer["JETRL_TRAINER__DTYPE"] == trainer["JETRL_TRAINER__PUBLISH_DTYPE"] == "bfloat16"
    # the weights in memory by CUDA IPC handle (colocated), in the servers' dtype
    assert (_weights(trainer)["transport"], _weights(trainer)["dtype"]) == ("colocated", "bfloat16")
    for name in ("inference-0", "inference-1"):
        server = _env(composed, name)
        assert (server["JETRL_INFERENCE__DEVICE"], server["JETRL_INFERENCE__DTYPE"]) == ("cuda", "bfloat16")
        assert float(server["JETRL_INFERENCE__MEMORY_FRACTION"]) == pytest.approx(0.2)  # the servers' 0.4 shared
        assert server["CUDA_VISIBLE_DEVICES"] == "3"
    _print_settings(UpSettings(dataset_path="d.jsonl", device="cuda"), composed.learning)
    assert "  up: device=cuda, dtype=bfloat16, serving_memory_fraction=0.3" in capsys.readouterr().out

    own: dict[str, dict[str, Any]] = {"inference": {"dtype": "float32", "memory_fraction": 0.5},
                                      "trainer": {"dtype": "float32", "weights": {"dtype": "float32"}}}
    composed = _compose(tmp_path, own, {}, device="cuda")
    trainer, server = _env(composed, "trainer"), _env(composed, "inference-0")
    assert trainer["JETRL_TRAINER__DTYPE"] == _weights(trainer)["dtype"] == "float32"
    assert server["JETRL_INFERENCE__DTYPE"] == "float32" and server["JETRL_INFERENCE__MEMORY_FRACTION"] == "0.5"
    assert server["JETRL_INFERENCE__DEVICE"] == "cuda"
    trainer = _env(_compose(tmp_path, {"inference": {"dtype": "float32"}}, {}, device="cuda"), "trainer")
    assert _weights(trainer)["dtype"] == "float32" and trainer["JETRL_TRAINER__DTYPE"] == "bfloat16"  # versions in the served dtype


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here: nothing to refuse")
def test_device_cuda_without_a_gpu_is_refused_before_anything_starts(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETRL_")} | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "services.up", "device=cuda", "run=r", f"run_dir={tmp_path}",
                          f"model_path={tmp_path / 'model'}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "up.device is cuda, but torch" in out.stderr and "sees no CUDA GPU" in out.stderr and "device=cpu" in out.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "model").exists(), "nothing started, nothing made"
