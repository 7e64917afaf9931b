"""Weight sync. `sender/`: the trainer's side (`WeightSync`, built by `make_weight_sync` from
`weights.transport`); `agent/`: `jetrl weights`, the agent that loads each announced version into its
inference server without stopping generation; here: what both sides read (files and hashes, the
object store, signing, the run's announcements)."""

from __future__ import annotations

from services.weights.settings import WeightsSettings

DESCRIPTION = (
    "Weights agent: loads the latest published weight version into one inference server at start, then "
    "each newly announced version (fetch, verify sha256, pause, update_weights_from_disk, continue)."
)


def main(argv: list[str] | None = None) -> int:
    from services.common.entry import service_main

    return service_main(WeightsSettings, "services.weights.agent.agent:run_agent", argv, DESCRIPTION)
