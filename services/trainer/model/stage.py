"""The DeepSpeed ZeRO stage a trainer runs: `zero_stage: auto` resolved for the world size, and the
stage each checkpoint was written with, since a checkpoint resumes only on its own stage (DeepSpeed's
layouts differ: stage 0 saves the optimizer with the model, ZeRO-1/2 per-rank flat partitions,
ZeRO-3 per-rank parameter shards too).

The stage is recorded in the checkpoint's directory (`STAGE_FILE`) before DeepSpeed writes it, so
every complete checkpoint has it. Checkpoints from before the record were written with the stage the
run set, ZeRO-2 by default then."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

STAGE_FILE = "jetrl_zero_stage"
UNRECORDED_STAGE: Literal[2] = 2
"""What `auto` resumes an unrecorded checkpoint on: the default stage when checkpoints had no record."""

Stage = Literal[0, 1, 2, 3]


def resolve(setting: Literal["auto", 0, 1, 2, 3], world_size: int, checkpoint: Path | None) -> Stage:
    """The stage to run: `auto` is the resumed checkpoint's stage, else 0 on one rank (no ZeRO: nothing
    to partition, and ZeRO-1/2 would add an fp32 master copy and gradient partitions) and 2 on several.
    An explicit stage that differs from the checkpoint's recorded one is refused."""
    written = recorded(checkpoint) if checkpoint is not None else None
    if setting == "auto":
        if written is not None:
            return written
        if checkpoint is not None:
            return UNRECORDED_STAGE
        fresh: Stage = 0 if world_size == 1 else 2
        return fresh
    if written is not None and written != setting:
        raise ValueError(f"zero_stage={setting}, but the checkpoint to resume ({checkpoint}) was written with ZeRO stage "
                         f"{written}, and DeepSpeed resumes a checkpoint only on its own stage: set zero_stage={written} "
                         "(or auto), or start afresh (resume=never)")
    return setting


def recorded(tag_dir: Path) -> Stage | None:
    """The stage recorded with a checkpoint, None where there is no record."""
    path = tag_dir / STAGE_FILE
    if not path.exists():
        return None
    text = path.read_text().strip()
    if text not in ("0", "1", "2", "3"):
        raise ValueError(f"{path}: a ZeRO stage (0-3) expected, found {text!r}")
    stage: Stage = int(text)  # type: ignore[assignment]
    return stage


def record(tag_dir: Path, stage: int) -> None:
    """Record the stage a checkpoint is about to be written with (before DeepSpeed writes it)."""
    tag_dir.mkdir(parents=True, exist_ok=True)
    (tag_dir / STAGE_FILE).write_text(f"{stage}\n")
