"""`jetrl replay`: the trainer in offline mode, training from a recorded range of a run's trajectory
stream (or from Parquet exports). `jetrl export` / `jetrl import` live in `export.py` / `import_.py`.

This module stays light so `--help` is instant; torch and DeepSpeed are imported by `service.py`.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from services.common.entry import service_main
    from services.replay.settings import ReplaySettings

    return service_main(
        ReplaySettings,
        "services.replay.service:run_service",
        argv,
        "Offline training from a recorded trajectory range (--from-seq/--to-seq or --since/--until, or "
        "parquet=[...]), with the trainer's own step, checkpoints and metrics under this run's name.",
    )
