"""The static gate: ruff, mypy and import-linter with the configuration in pyproject.toml, from the
repository root, the checks `./dev lint` runs. A finding fails the test with the tool's own report."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_tool(module: str, *args: str, timeout_s: float) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[dev]')")
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, f"{module} {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"


def test_ruff_finds_nothing() -> None:
    run_tool("ruff", "check", "--output-format=concise", ".", timeout_s=120)


@pytest.mark.timeout(600)
def test_mypy_finds_nothing() -> None:
    # incremental: .mypy_cache at the root makes a warm run take seconds (~80 s cold on 2 busy cores)
    run_tool("mypy", timeout_s=540)


def test_import_layering_holds() -> None:
    """import-linter's contracts in pyproject.toml: schemas import no service, common no other service,
    no circle inside a service."""
    if importlib.util.find_spec("importlinter") is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    tool = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(tool), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"lint-imports failed:\n{proc.stdout}{proc.stderr}"
