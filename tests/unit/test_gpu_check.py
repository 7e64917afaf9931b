"""The one-call GPU check (infra/gpu_check/): every module it imports is on the lent machine or in
its carried wheelhouse, for Python 3.12. The static half needs no network; the wheelhouse half runs
where `python infra/gpu_check/prepare.py` has downloaded and built the wheels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

GPU_CHECK = Path(__file__).resolve().parents[2] / "infra" / "gpu_check"
sys.path.insert(0, str(GPU_CHECK))

import imports  # noqa: E402
import prepare  # noqa: E402


def test_every_import_of_the_gpu_check_is_required_or_on_the_device() -> None:
    found = imports.third_party()
    # the walk reaches them (matplotlib and rich: `jetrl up device=cuda`, tests/gpu/test_up_cuda.py)
    assert {"torch", "deepspeed", "pydantic_settings", "structlog", "nats", "pytest", "matplotlib", "rich"} <= set(found)
    missing = {m: where for m, where in found.items() if m not in prepare.declared_imports() and m not in prepare.OPTIONAL}
    assert missing == {}, f"add these to infra/gpu_check/requirements.txt (or prepare.DEVICE_HAS): {missing}"
    assert not {r.name for r in prepare.requirements()} & {"torch", "nvidia-cuda-runtime-cu12", "triton"}
    assert set(prepare.BINARIES.values()) <= {r.name for r in prepare.requirements()}, "nats-server's wheel is carried"


@pytest.mark.skipif(not list((GPU_CHECK / "wheels").glob("*.whl")), reason="no wheelhouse here: python infra/gpu_check/prepare.py")
def test_the_wheelhouse_resolves_every_import_for_python_3_12_within_64_mib() -> None:
    assert prepare.verify() == []
