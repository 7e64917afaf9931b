"""`jetrl rollout`: the rollout worker (workflow API in `workflow.py`, loop in `worker.py`)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from services.common.entry import service_main
    from services.rollout.settings import RolloutSettings

    return service_main(
        RolloutSettings,
        "services.rollout.service:run",
        argv,
        "Rollout worker: pulls prompts from the PROMPTS work queue, runs the workflow's episodes, "
        "publishes one trajectory message per prompt.",
    )
