"""`jetrl up`'s process layout: torch threads derived from the cores unless set; two rollout workers
unless set."""

from __future__ import annotations

from pathlib import Path

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


def test_only_the_processes_no_step_waits_for_run_at_a_lower_priority() -> None:
    from services.up.layout import niceness

    s = UpSettings()
    assert niceness(s, "weights", broadcast=True) == s.background_nice == 10
    assert niceness(s, "track", broadcast=True) == niceness(s, "track", broadcast=False) == 10
    # on the disk path every version waits for an agent's load: the agents keep the common priority
    assert niceness(s, "weights", broadcast=False) == 0
    for service in ("trainer", "inference", "rollout", "reward"):
        assert niceness(s, service, broadcast=True) == 0
    assert niceness(UpSettings(background_nice=0), "weights", broadcast=True) == 0


def test_a_process_started_nice_runs_at_that_lower_priority(tmp_path: Path) -> None:
    import os

    from services.up.stack import Stack

    (tmp_path / "idle_child.py").write_text("import signal\nsignal.pause()\n")  # lives until stopped
    stack = Stack(tmp_path, {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(tmp_path)})
    try:
        plain = stack.start("plain", "idle_child", {}, required=False)
        nice = stack.start("nice", "idle_child", {}, required=False, nice=7)
        assert plain.pid is not None and nice.pid is not None
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, plain.pid) == own
        assert os.getpriority(os.PRIO_PROCESS, nice.pid) == min(19, own + 7)
        assert plain.poll() is None and nice.poll() is None
    finally:
        stack.stop(5.0)
    assert plain.poll() is not None and nice.poll() is not None
