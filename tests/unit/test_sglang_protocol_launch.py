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
                          context_length=2048, sglang_args=["--tp-size=2"], skip_tokenizer_init=True)
    argv = launch_argv(s)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    for flag in ("--model-path=/m", "--port=30001", "--weight-version=4", "--max-running-requests=32",
                 "--context-length=2048", "--skip-tokenizer-init", "--enable-metrics", "--tp-size=2"):
        assert flag in argv
    # without skip_tokenizer_init SGLang keeps its tokenizer, and so its grammar backend (structured output)
    assert "--skip-tokenizer-init" not in launch_argv(s.model_copy(update={"skip_tokenizer_init": False}))
    with pytest.raises(ValueError, match="fixed port"):
        launch_argv(InferenceSettings(engine="sglang", port=0))


def test_the_gpu_compose_profile_launches_sglang_through_jetrl_inference() -> None:
    """The GPU profile runs `jetrl inference` with engine=sglang, so SGLang gets exactly the flags of
    `launch_argv` (tested above), the admin key included, instead of a hand-copied command line."""
    import yaml

    spec = yaml.safe_load(COMPOSE.read_text())["services"]["inference-sglang"]
    env = spec["environment"]
    assert env["JETRL_INFERENCE__ENGINE"] == "sglang" and "command" not in spec
    assert env["JETRL_INFERENCE__ADMIN_API_KEY_FILE"].startswith("/run/secrets/")
    assert re.search(r"curl -fsS http://127\.0\.0\.1:30000/ready", " ".join(spec["healthcheck"]["test"]))


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_without_the_sglang_package_engine_sglang_fails_at_start_saying_so() -> None:
    with pytest.raises(RuntimeError, match="sglang package is not installed"):
        check_available()
