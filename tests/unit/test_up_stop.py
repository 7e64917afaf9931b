"""Where `jetrl up` stops on its own: the demo once it has learned copy3 (a 10-step mean reward of
0.9), a run on a dataset of your own only at its step budget unless told otherwise."""

from __future__ import annotations

from pathlib import Path

from services.up.run import stop_at_reward
from services.up.settings import UpSettings


def test_the_demo_stops_at_0_9_and_a_dataset_of_your_own_runs_its_budget() -> None:
    assert stop_at_reward(UpSettings()) == 0.9
    assert stop_at_reward(UpSettings(dataset_path="mine.jsonl")) == 0.0
    assert stop_at_reward(UpSettings(dataset_path="mine.jsonl", stop_at_reward=0.7)) == 0.7
    assert stop_at_reward(UpSettings(stop_at_reward=0)) == 0.0


def test_stop_lets_the_rollout_workers_drain_before_the_services_their_episodes_need_stop(tmp_path: Path) -> None:
    """A rollout worker's SIGTERM drains its in-flight episodes, which call the servers and the reward
    service: those get their SIGTERM only once the workers have ended."""
    import os

    from services.up.stack import DRAINED_FIRST, Stack
    from tests.support.waiting import wait_until

    events = tmp_path / "events.txt"
    (tmp_path / "draining.py").write_text(  # on SIGTERM: finishes an episode (0.3 s of work), then exits
        "import signal, sys, time\n"
        f"def end(*_):\n    time.sleep(0.3)\n    open({str(events)!r}, 'a').write('episode drained\\n')\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, end)\nopen(sys.argv[0] + '.up', 'w').close()\nsignal.pause()\n")
    (tmp_path / "serving.py").write_text(
        "import signal, sys\n"
        f"def end(*_):\n    open({str(events)!r}, 'a').write('server stopped\\n')\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, end)\nopen(sys.argv[0] + '.up', 'w').close()\nsignal.pause()\n")
    stack = Stack(tmp_path, {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(tmp_path)})
    stack.drained_first = frozenset({"draining"})
    try:
        stack.start("inference-0", "serving", {}, required=False)
        stack.start("rollout-0", "draining", {}, required=False)
        for name in ("serving", "draining"):  # both have their SIGTERM handlers in place
            ready = tmp_path / f"{name}.py.up"
            wait_until(f"{name} ready", ready.exists, timeout_s=60)
    finally:
        stack.stop(20.0)
    assert events.read_text().splitlines() == ["episode drained", "server stopped"]
    assert "services.rollout" in DRAINED_FIRST  # jetrl up's own rollout workers are the ones drained first

