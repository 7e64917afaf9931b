"""The learning-rate schedule: linear warmup from 0, then constant, cosine or linear decay to
`lr_min_ratio` x lr. Counted in optimizer steps (one per mini-batch), stepped by DeepSpeed after each
optimizer step and saved in its checkpoints, so a resumed run continues the schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from services.trainer.settings import TrainerSettings


def lr_factor(step: int, schedule: str, warmup: int, decay_steps: int, min_ratio: float) -> float:
    """The multiplier of the base lr for optimizer step `step` (0-based: the lr the step uses)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(max(step - warmup, 0) / max(decay_steps - warmup, 1), 1.0)
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    raise ValueError(f"lr_schedule {schedule!r}: expected constant, cosine or linear")


def decay_steps(settings: TrainerSettings) -> int:
    """Optimizer steps over which cosine/linear decay: `lr_decay_steps`, else total_steps x n_minibatches."""
    return settings.lr_decay_steps or settings.total_steps * settings.ppo.n_minibatches


def scheduler(settings: TrainerSettings, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR | None:
    """None for a constant lr without warmup (the optimizer's lr is used as is)."""
    if settings.lr_schedule == "constant" and settings.warmup_steps == 0:
        return None
    fn: Callable[[int], float] = lambda step: lr_factor(  # noqa: E731
        step, settings.lr_schedule, settings.warmup_steps, decay_steps(settings), settings.lr_min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
