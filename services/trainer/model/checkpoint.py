"""Checkpoint layout and the trainer state that travels with the DeepSpeed checkpoint.

`<output_dir>/checkpoints/<tag>/` is a DeepSpeed checkpoint (model, optimizer, per-rank partitions)
whose client_state holds the trainer state: version, last consumed stream sequence, the feeder's
cursor and counters, the trained prompt ids, RNG states. DeepSpeed's `latest` file names the newest
tag; it is written last, so a checkpoint cut short by a kill is never picked.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def tag_for(version: int) -> str:
    return f"v{version:08d}"


def latest(root: Path) -> str | None:
    """The tag DeepSpeed marked latest, if its directory exists."""
    marker = root / "latest"
    if not marker.exists():
        return None
    tag = marker.read_text().strip()
    return tag if (root / tag).is_dir() else None


def resolve_resume(resume: str, output_dir: str | Path) -> tuple[Path, str] | None:
    """(checkpoint root, tag) to resume from, or None for a fresh start. `resume` is auto | never | a
    checkpoint dir (`.../checkpoints/<tag>`)."""
    if resume == "never":
        return None
    if resume == "auto":
        root = checkpoint_root(output_dir)
        tag = latest(root)
        return (root, tag) if tag else None
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"resume={resume}: no such checkpoint directory")
    return path.parent, path.name


def prune(root: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` tags (never the one `latest` names)."""
    current = latest(root)
    tags = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("v"))
    doomed = [t for t in tags[:-keep] if t != current]
    for tag in doomed:
        shutil.rmtree(root / tag, ignore_errors=True)
    return doomed


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
