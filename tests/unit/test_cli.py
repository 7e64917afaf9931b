"""`jetrl --help` and `jetrl <service> --help` list commands and settings with their docs, fast."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from services.cli import COMMANDS


def jetrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=60)


def test_top_level_help_lists_every_command() -> None:
    out = jetrl("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


def test_unknown_command_is_an_error() -> None:
    out = jetrl("nope")
    assert out.returncode == 2
    assert "unknown command 'nope'" in out.stderr


def _available(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError:
        return False
    return True


SERVICES = [
    n
    for n in ("inference", "rollout", "reward", "trainer", "weights")
    if _available(f"services.{n}") and hasattr(importlib.import_module(f"services.{n}"), "main")
]


@pytest.mark.parametrize("name", SERVICES)
def test_service_help_lists_settings_with_docs(name: str) -> None:
    out = jetrl(name, "--help")
    assert out.returncode == 0, out.stderr
    assert "nats_url" in out.stdout and "NATS server URL" in out.stdout
    assert f"JETRL_{name.upper()}__" in out.stdout
    # --help must not pay for torch: settings are validated before heavy imports
    probe = (
        "import sys\nfrom services.cli import main\n"
        f"try:\n    main([{name!r}, '--help'])\nexcept SystemExit:\n    pass\n"
        "print('HEAVY' if 'torch' in sys.modules else 'LIGHT')"
    )
    light = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert light.stdout.strip().endswith("LIGHT"), light.stdout[-300:]


def test_bad_setting_exits_2_naming_it() -> None:
    if not SERVICES:
        pytest.skip("no service package yet")
    out = jetrl(SERVICES[0], "no_such_key=1")
    assert out.returncode == 2
    assert "no_such_key: unknown key" in out.stderr
