"""Start-up cost: on a small machine every process of `jetrl up` imports its libraries at once, so a
process that does not need torch (1+ CPU-s), transformers or numpy must not import them. Each module
is imported in a fresh interpreter and its `sys.modules` checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "deepspeed", "numpy")


def _imported(module: str) -> list[str]:
    code = f"import json, sys; import {module}; print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "module",
    [
        "services.up.run",  # `jetrl up` until its services are started (the curve's numpy comes at the end)
        "services.up.launch",  # `jetrl up` until the fork server is started (it imports torch, `up` does not)
        "services.weights.agent.agent",  # the weights agent
        "services.common.entry",  # every service's entry point, before its settings are parsed
        "services.cli",  # `jetrl`
    ],
)
def test_a_process_that_needs_no_tensors_imports_none_of_their_libraries(module: str) -> None:
    assert _imported(module) == []
