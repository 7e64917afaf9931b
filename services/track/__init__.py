"""`jetrl track`: follow a run's METRICS stream and write every service's figures to experiment
trackers (TensorBoard event files, Weights & Biases online or offline). A separate process reading
the recorded stream, so a tracker that is slow or failing can never stop or slow training."""

from __future__ import annotations

from services.common.entry import service_main
from services.track.settings import TrackSettings


def main(argv: list[str] | None = None) -> int:
    return service_main(
        TrackSettings,
        "services.track.service:run",
        argv,
        "Follow a run's METRICS stream and write train, eval, rollout and staleness figures to TensorBoard "
        "and/or Weights & Biases (online or offline), with the run's config.",
    )
