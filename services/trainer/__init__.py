"""`jetrl trainer`: DeepSpeed ZeRO trainer (decoupled PPO / GRPO) with the prompt feeder.

The shell (`loop.py` the step, `service.py` the process, `versions.py` the version window,
`settings.py`) over three rooms: `feed/` (prompts out), `intake/` (trajectories in), `model/` (the
engine and the update); `algorithms/` holds the advantages and losses (docs/trainer.md).

This module stays light so `--help` is instant; torch and DeepSpeed are imported by `service.py`.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from services.common.entry import service_main
    from services.trainer.settings import TrainerSettings

    return service_main(
        TrainerSettings,
        "services.trainer.service:run_service",
        argv,
        "DeepSpeed ZeRO trainer: feeds prompts under the staleness budget, trains on trajectories with "
        "decoupled PPO, publishes weights, checkpoints and resumes exactly (--resume auto).",
    )
