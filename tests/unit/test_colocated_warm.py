"""The colocated weight sender starts torch's shared-memory manager while the trainer's engine builds
(`ColocatedSender.build_ahead`), so the first version does not wait ~0.16 s for it inside the first step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILDREN = """
import asyncio, sys
import psutil
from services.weights.sender.colocated import ColocatedSender

async def main() -> None:
    sender = ColocatedSender(["http://127.0.0.1:9"])
    if sys.argv[1] == "ahead":
        assert await sender.build_ahead(1.0) == []
    print(sorted(c.name() for c in psutil.Process().children()))
    await sender.aclose()

asyncio.run(main())
"""


def _children(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", _CHILDREN, mode], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_build_ahead_starts_the_shared_memory_manager_before_the_first_version() -> None:
    assert "torch_shm_manager" not in _children("cold")  # a fresh sender has not started it
    assert "torch_shm_manager" in _children("ahead")
