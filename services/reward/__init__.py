"""`jetrl reward`: reward functions scored in a process pool behind the NATS micro-service endpoint
`jetrl.reward.score` (queue group `jetrl-reward`). Callers use `services.reward.client.RewardClient`."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    # imported here, not at the top: the fork server and every pool process import this package (for
    # the worker) and need none of the settings and logging machinery
    from services.common.entry import service_main
    from services.reward.settings import RewardSettings

    return service_main(
        RewardSettings,
        "services.reward.service:run",
        argv,
        "Score batches of (prompt, completion) items with allow-listed reward functions in a process pool, "
        "answering requests on jetrl.reward.score (NATS micro-service, queue group jetrl-reward).",
    )
