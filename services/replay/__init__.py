"""`jetrl replay`: the trainer in offline mode, training from a recorded range of a run's trajectory
stream (or from Parquet exports). `jetrl export` / `jetrl import` live in `export.py` / `import_.py`.

This module stays light so `--help` is instant; torch and DeepSpeed are imported by `service.py`.
"""

from __future__ import annotations

import sys

# The documented flags, as spellings of settings (`--from-seq 10` is `range.from_seq=10`).
FLAGS = {
    "--from-seq": "range.from_seq",
    "--to-seq": "range.to_seq",
    "--since": "range.since",
    "--until": "range.until",
    "--min-version": "range.min_version",
    "--max-version": "range.max_version",
    "--kind": "range.kind",
    "--source-run": "source_run",
    "--output": "output",
    "--resume": "resume",
}


def flags_to_overrides(argv: list[str]) -> list[str]:
    """`--from-seq 10` / `--from-seq=10` -> `range.from_seq=10`; `--follow` -> `range.follow=true`;
    anything else is passed through."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in FLAGS:
            if not eq:
                value = next(it, "")
            out.append(f"{FLAGS[name]}={value}")
        elif arg == "--follow":
            out.append("range.follow=true")
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    from services.common.entry import service_main
    from services.replay.settings import ReplaySettings

    return service_main(
        ReplaySettings,
        "services.replay.service:run_service",
        flags_to_overrides(list(sys.argv[1:] if argv is None else argv)),
        "Offline training from a recorded trajectory range (--from-seq/--to-seq or --since/--until, or "
        "parquet=[...]), with the trainer's own step, checkpoints and metrics under this run's name.",
    )
