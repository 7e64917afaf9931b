"""`engine: sglang`: the `sglang.launch_server` command jetrl runs, and a clear refusal where it cannot."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from services.inference.settings import InferenceSettings
from services.inference.sglang_launch import check_available, launch_argv

COMPOSE = Path(__file__).resolve().parents[2] / "infra" / "compose.yaml"


def test_the_launch_command_carries_the_settings_and_the_flags_jetrl_needs() -> None:
    s = InferenceSettings(engine="sglang", model_path="/m", port=30001, weight_version="4", max_batch_size=32,
                          context_length=2048, sglang_args=["--tp-size=2"])
    argv = launch_argv(s)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    for flag in ("--model-path=/m", "--port=30001", "--weight-version=4", "--max-running-requests=32",
                 "--context-length=2048", "--skip-tokenizer-init", "--enable-metrics", "--tp-size=2"):
        assert flag in argv
    with pytest.raises(ValueError, match="fixed port"):
        launch_argv(InferenceSettings(engine="sglang", port=0))


def test_the_gpu_compose_profile_passes_the_same_jetrl_flags() -> None:
    text = COMPOSE.read_text()
    block = text[text.index("inference-sglang:"):text.index("weights:", text.index("inference-sglang:"))]
    for flag in ("--skip-tokenizer-init", "--weight-version=0", "--enable-metrics"):
        assert f"- {flag}" in block
    assert re.search(r"curl -fsS http://127\.0\.0\.1:30000/ready", block)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_without_the_sglang_package_engine_sglang_fails_at_start_saying_so() -> None:
    with pytest.raises(RuntimeError, match="sglang package is not installed"):
        check_available()
