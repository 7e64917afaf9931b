"""`jetrl up`'s process layout: torch threads derived from the cores unless set; one rollout worker
unless set."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.up.layout import layout
from services.up.settings import UpSettings


@pytest.mark.parametrize(
    ("cores", "servers", "workers", "threads"),
    [(1, 1, 1, 1), (2, 1, 1, 1), (4, 1, 1, 2), (8, 1, 1, 4), (8, 3, 1, 2), (64, 1, 1, 32)],
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


def test_what_no_step_waits_for_runs_last_and_the_servers_can_yield_to_the_trainer() -> None:
    from services.up.layout import priorities

    s = UpSettings(serving_nice=5)
    nice = priorities(s, broadcast=True)
    assert "services.trainer" not in nice  # 0: the trainer's step gets a core first
    assert nice["services.inference"] == nice["services.rollout"] == nice["services.reward"] == 5
    assert nice["services.weights"] == nice["services.track"] == s.background_nice == 10
    # on the disk path every version waits for an agent's load: the agents rank with the servers
    assert priorities(s, broadcast=False)["services.weights"] == 5
    default = priorities(UpSettings(), broadcast=True)  # only what no step waits for is lowered by default
    assert {m for m, n in default.items() if n} == {"services.weights", "services.track"}
    assert set(priorities(UpSettings(serving_nice=0, background_nice=0), broadcast=True).values()) == {0}


def test_a_process_started_nice_runs_at_that_lower_priority(tmp_path: Path) -> None:
    import os

    from services.up.stack import Stack

    (tmp_path / "idle_child.py").write_text("import signal\nsignal.pause()\n")  # lives until stopped
    stack = Stack(tmp_path, {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(tmp_path)})
    try:
        stack.nice = {"idle_child": 7}  # by module, unless a start says otherwise
        plain = stack.start("plain", "idle_child", {}, required=False, nice=0)
        nice = stack.start("nice", "idle_child", {}, required=False)
        assert plain.pid is not None and nice.pid is not None
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, plain.pid) == own
        assert os.getpriority(os.PRIO_PROCESS, nice.pid) == min(19, own + 7)
        assert plain.poll() is None and nice.poll() is None
    finally:
        stack.stop(5.0)
    assert plain.poll() is not None and nice.poll() is not None


@pytest.mark.parametrize(
    ("cpus", "threads", "trainer", "others"),
    [([0, 1], None, (0,), (1,)), ([2, 5, 7, 9], None, (2, 5), (7, 9)), ([0, 1, 2, 3], 3, (0, 1, 2), (3,))],
)
def test_pin_trainer_gives_the_trainer_its_threads_cores_and_the_rest_to_every_other_service(
        cpus: list[int], threads: int | None, trainer: tuple[int, ...], others: tuple[int, ...]) -> None:
    shape = layout(UpSettings(pin_trainer=True, torch_threads=threads, beside_trainer=[]), cpus=cpus)
    assert (shape.trainer_cpus, shape.other_cpus) == (trainer, others)  # at least one core is left to the others
    assert shape.cpus("services.trainer") == trainer
    assert shape.cpus("services.inference") == shape.cpus("services.rollout") == shape.cpus("services.reward") == others


def test_pinned_by_default_unless_turned_off_or_no_core_is_left_to_the_others() -> None:
    assert layout(UpSettings(), cpus=[0, 1]).cpus("services.trainer") == (0,)
    assert layout(UpSettings(pin_trainer=False), cpus=[0, 1]).cpus("services.trainer") == ()
    assert layout(UpSettings(), cpus=[3]).cpus("services.trainer") == ()  # one core
    assert layout(UpSettings(torch_threads=2), cpus=[0, 1]).cpus("services.inference") == ()  # the real-model example's layout


def test_beside_trainer_puts_the_named_services_on_the_trainers_cores_and_never_a_server() -> None:
    shape = layout(UpSettings(beside_trainer=["reward", "weights"]), cpus=[0, 1])
    assert shape.cpus("services.reward") == shape.cpus("services.weights") == shape.cpus("services.trainer") == (0,)
    assert shape.cpus("services.rollout") == shape.cpus("services.inference") == (1,)
    assert layout(UpSettings(beside_trainer=["reward"], pin_trainer=False), cpus=[0, 1]).cpus("services.reward") == ()
    assert layout(UpSettings(beside_trainer=[]), cpus=[0, 1]).cpus("services.reward") == (1,)


def test_by_default_reward_and_weights_share_a_one_thread_trainers_core_but_not_a_thread_teams() -> None:
    one = layout(UpSettings(), cpus=[0, 1])
    assert one.cpus("services.reward") == one.cpus("services.weights") == (0,)
    assert one.cpus("services.rollout") == (1,)
    team = layout(UpSettings(torch_threads=2), cpus=[0, 1, 2, 3])  # an OpenMP team of 2 on cores 0-1
    assert team.cpus("services.trainer") == (0, 1)
    assert team.cpus("services.reward") == team.cpus("services.weights") == (2, 3)
    with pytest.raises(ValidationError, match="inference"):
        UpSettings(beside_trainer=["inference"])


def test_a_pinned_child_runs_only_on_its_cores() -> None:
    import os
    import subprocess
    import sys

    from services.up.child import child_setup

    first = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], capture_output=True,
                         text=True, check=True, preexec_fn=child_setup(0, (first,))).stdout
    assert out.strip() == f"[{first}]"


def test_a_child_that_cannot_be_pinned_still_runs_unpinned() -> None:
    import os
    import subprocess
    import sys

    from services.up.child import child_setup

    out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], capture_output=True,
                         text=True, check=True, preexec_fn=child_setup(0, (4095,))).stdout  # no such core here
    assert out.strip() == str(sorted(os.sched_getaffinity(0)))
