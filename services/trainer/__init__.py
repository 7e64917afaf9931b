"""`jetrl trainer`: DeepSpeed ZeRO trainer (decoupled PPO / GRPO) with the prompt feeder.

This module stays light so `--help` is instant; torch and DeepSpeed are imported by `service.py`.
"""

from __future__ import annotations

import sys


def _flag_to_override(argv: list[str]) -> list[str]:
    """Accept `--resume auto` / `--resume=auto` as the setting `resume=auto` (the documented spelling)."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--resume":
            out.append(f"resume={next(it, 'auto')}")
        elif arg.startswith("--resume="):
            out.append(f"resume={arg.split('=', 1)[1]}")
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    from services.common.entry import service_main
    from services.trainer.settings import TrainerSettings

    args = _flag_to_override(list(sys.argv[1:] if argv is None else argv))
    return service_main(
        TrainerSettings,
        "services.trainer.service:run_service",
        args,
        "DeepSpeed ZeRO trainer: feeds prompts under the staleness budget, trains on trajectories with "
        "decoupled PPO, publishes weights, checkpoints and resumes exactly (--resume auto).",
    )
