"""AReaL from PyPI for the AReaL tier, read as a test input: its own workflow, reward and agent files.

`install()` puts the pinned `areal` wheel, unpacked with `pip install --no-deps` (nothing else: no
torch, no CUDA packages), into `.cache/areal/<version>/` once (a stamp file, a file lock for xdist
workers); `JETRL_AREAL_CACHE` moves the cache. When PyPI cannot be reached the tier is skipped with
the reason. AReaL's code is never copied into the repository: the tier ports it into a temporary
directory at run time (`port.py`)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

VERSION = "1.0.4"
ROOT = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    return Path(os.environ.get("JETRL_AREAL_CACHE") or ROOT / ".cache" / "areal")


def install(version: str = VERSION) -> Path:
    """The directory holding AReaL's `areal/` package source at `version`; skips the test when the
    wheel cannot be had."""
    target = cache_dir() / version
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = target / ".jetrl-installed"
        if stamp.is_file():
            return target
        partial = target.with_name(target.name + ".partial")
        subprocess.run(["rm", "-rf", str(partial)], check=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--no-compile",
             "--target", str(partial), f"areal=={version}"],
            capture_output=True, text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"areal=={version} could not be installed from PyPI (unreachable?): {done.stderr.strip()[-300:]}")
        subprocess.run(["rm", "-rf", str(target)], check=True)
        partial.rename(target)
        stamp.write_text(version)
        return target
