"""Where `jetrl up` stops on its own: the demo once it has learned copy3 (a 10-step mean reward of
0.9), a run on a dataset of your own only at its step budget unless told otherwise."""

from __future__ import annotations

from services.up.run import stop_at_reward
from services.up.settings import UpSettings


def test_the_demo_stops_at_0_9_and_a_dataset_of_your_own_runs_its_budget() -> None:
    assert stop_at_reward(UpSettings()) == 0.9
    assert stop_at_reward(UpSettings(dataset_path="mine.jsonl")) == 0.0
    assert stop_at_reward(UpSettings(dataset_path="mine.jsonl", stop_at_reward=0.7)) == 0.7
    assert stop_at_reward(UpSettings(stop_at_reward=0)) == 0.0
