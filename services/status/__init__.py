"""`jetrl status`: where a run stands. Starts with weight sync (the latest published version, each
server's loaded version and lag); other sections can be added beside `weights.py`."""

from __future__ import annotations

from services.status.settings import StatusSettings

DESCRIPTION = (
    "Show a run's state: the latest published weight version and each inference server's loaded version and lag; "
    "streams, consumer lag, prompts in flight, which workers are alive, and the trajectory groups the trainer "
    "read, with those it terminated by cause; the rollout workers' failed episodes (by exception type), rejected episodes "
    "and shrunk groups."
)


def main(argv: list[str] | None = None) -> int:
    from services.common.entry import service_main

    return service_main(StatusSettings, "services.status.report:run_status", argv, DESCRIPTION)
