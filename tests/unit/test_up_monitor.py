"""`jetrl up` stops at the first step whose 10-step mean reward reaches `stop_at_reward`, even when the
mean falls back below it before the display next looks (it refreshes every 0.5 s, ~6 steps of the demo)."""

from __future__ import annotations

from schemas import metric_names as names
from schemas.messages import MetricsEvent
from services.up.monitor import RunView


def _feed(view: RunView, rewards: list[float]) -> None:
    for step, reward in enumerate(rewards, start=1):
        view.add(MetricsEvent(run="r", service="trainer", step=step, version=step, values={names.REWARD_MEAN: reward}))


def test_a_mean_that_crosses_and_falls_back_is_still_the_stop() -> None:
    view = RunView(started=0.0, target=0.9)
    # steps 1-9 at 0.9, step 10 at 1.0 (mean 0.91: reached), then a dip that takes the window below 0.9
    _feed(view, [0.9] * 9 + [1.0] + [0.5] * 5)
    assert view.reached_at == 10
    assert (view.recent((names.REWARD_MEAN,)) or 0) < 0.9  # what a look after the dip would have seen


def test_nothing_reached_below_the_target_or_before_ten_steps() -> None:
    early = RunView(started=0.0, target=0.9)
    _feed(early, [1.0] * 9)
    assert early.reached_at is None  # nine steps are no 10-step mean
    low = RunView(started=0.0, target=0.9)
    _feed(low, [0.89] * 30)
    assert low.reached_at is None
    unwatched = RunView(started=0.0)
    _feed(unwatched, [1.0] * 30)
    assert unwatched.reached_at is None


def test_a_repeated_step_event_counts_once() -> None:
    view = RunView(started=0.0, target=0.9)
    _feed(view, [0.0] * 9)
    for _ in range(5):  # the same step reported again (a redelivered event) does not fill the window
        view.add(MetricsEvent(run="r", service="trainer", step=9, version=9, values={names.REWARD_MEAN: 1.0}))
    assert len(view.steps) == 9 and view.reached_at is None


def _eval(view: RunView, step: int, rate: float) -> None:
    view.add(MetricsEvent(run="r", service="eval", step=step, version=step, values={names.EVAL_ACCURACY: rate}))


def test_the_eval_lift_stop_is_the_first_round_that_far_over_step_0_whatever_order_the_rounds_arrive_in() -> None:
    view = RunView(started=0.0, eval_lift=0.15)
    _eval(view, 20, 0.30)  # answered before the step-0 round: nothing to hold it against yet
    assert view.lifted_at is None
    _eval(view, 0, 0.10)
    assert view.lifted_at == 20
    _eval(view, 10, 0.26)  # a round of an earlier step, answered later, is the one that lifted first
    assert view.lifted_at == 20  # once stopped, the stop stands (the run is ending)
    early = RunView(started=0.0, eval_lift=0.15)
    for step, rate in ((0, 0.10), (10, 0.24), (20, 0.26)):
        _eval(early, step, rate)
    assert early.lifted_at == 20 and early.eval_at(10) == 0.24


def test_no_eval_lift_stop_below_the_lift_or_unasked() -> None:
    low = RunView(started=0.0, eval_lift=0.15)
    for step, rate in ((0, 0.10), (10, 0.24), (20, 0.2499)):
        _eval(low, step, rate)
    assert low.lifted_at is None
    unwatched = RunView(started=0.0)
    for step, rate in ((0, 0.0), (10, 1.0)):
        _eval(unwatched, step, rate)
    assert unwatched.lifted_at is None


def test_an_eval_lift_without_a_step_0_round_is_refused_before_anything_starts() -> None:
    import pytest

    from services.common.settings import SettingsError
    from services.up.launch import validate_sections

    with pytest.raises(SettingsError, match="eval_at_start"):
        validate_sections({"trainer": {"feeder": {"eval_every": 10}}}, "task:arith", 0.15)
    validate_sections({"trainer": {"feeder": {"eval_every": 10, "eval_at_start": True}}}, "task:arith", 0.15)
    validate_sections({}, "task:arith", None)
