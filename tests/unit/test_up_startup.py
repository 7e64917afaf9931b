"""`jetrl up`'s process layout: torch threads derived from the cores unless set; two rollout workers
unless set."""

from __future__ import annotations

import pytest

from services.up.layout import layout
from services.up.settings import UpSettings


@pytest.mark.parametrize(
    ("cores", "servers", "workers", "threads"),
    [(1, 1, 2, 1), (2, 1, 2, 1), (4, 1, 2, 2), (8, 1, 2, 4), (8, 3, 2, 2), (64, 1, 2, 32)],
)
def test_unset_settings_are_derived_from_the_cores(cores: int, servers: int, workers: int, threads: int) -> None:
    shape = layout(UpSettings(inference_servers=servers), cores)
    assert (shape.cores, shape.rollout_workers, shape.torch_threads) == (cores, workers, threads)


def test_a_setting_wins_over_the_derived_value() -> None:
    shape = layout(UpSettings(rollout_workers=3, torch_threads=2), 2)
    assert (shape.rollout_workers, shape.torch_threads) == (3, 2)


def test_the_layout_follows_this_process_affinity() -> None:
    import os

    assert layout(UpSettings()).cores == len(os.sched_getaffinity(0))
