"""The tracker's guard: a sink that keeps failing is counted and switched off, the others go on."""

from __future__ import annotations

from typing import Any

from schemas.messages import MetricsEvent, encode
from services.track.service import Tracker, row_of
from services.track.settings import TrackSettings
from services.track.sinks import Guarded


class Recording:
    name = "recording"

    def __init__(self) -> None:
        self.rows: list[tuple[dict[str, float], int]] = []

    def log_config(self, config: dict[str, Any]) -> None: ...
    def write(self, values: dict[str, float], step: int) -> None:
        self.rows.append((values, step))
    def flush(self) -> None: ...
    def close(self) -> None: ...


class Broken(Recording):
    name = "broken"

    def write(self, values: dict[str, float], step: int) -> None:
        raise OSError("disk full")


def test_a_failing_sink_is_counted_switched_off_and_the_others_go_on() -> None:
    good, bad = Guarded(Recording(), 3), Guarded(Broken(), 3)
    tracker = Tracker(TrackSettings(), [bad, good])
    for step in range(1, 6):
        tracker.handle(encode(MetricsEvent(run="r", service="trainer", step=step, values={"reward_mean": step / 10})))
    tracker.handle(b"not msgpack")
    assert [s for _, s in good.sink.rows] == [1, 2, 3, 4, 5]  # type: ignore[attr-defined]
    assert bad.failures == 3 and bad.off
    assert tracker.stats()["malformed"] == 1


def test_rollout_figures_are_named_by_worker_and_carry_the_latest_trainer_step() -> None:
    rec = Guarded(Recording(), 3)
    tracker = Tracker(TrackSettings(), [rec])
    tracker.handle(encode(MetricsEvent(run="r", service="trainer", step=7, values={"loss": 0.5})))
    tracker.handle(encode(MetricsEvent(run="r", service="rollout", worker="w1", values={"episodes_per_s": 3.0})))
    assert rec.sink.rows[-1] == ({"rollout.w1/episodes_per_s": 3.0}, 7)  # type: ignore[attr-defined]
    # a workflow's own stats_tracker scalar (`<scope>/<name>`) is tracked under its worker too
    tracker.handle(encode(MetricsEvent(run="r", service="rollout", worker="w1", values={"rollout/reward": 0.25})))
    assert rec.sink.rows[-1] == ({"rollout.w1/rollout/reward": 0.25}, 7)  # type: ignore[attr-defined]
    assert row_of(MetricsEvent(run="r", service="trainer", worker="rank0", values={"x": 1.0})) == {"trainer/x": 1.0}
