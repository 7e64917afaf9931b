"""`jetrl up`'s process layout reaches the processes: the rollout workers it starts and the torch threads
the trainer reports are the ones its `up:` settings ask for (a short real run: nats-server, DeepSpeed
trainer, inference server, weights agent, reward, rollout worker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.up import finish, left_behind, start_up


def events(log: Path, name: str) -> list[dict]:
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            event = json.loads(line)
            if event.get("event") == name:
                found.append(event)
    return found


@pytest.mark.timeout(900)
def test_the_trainer_runs_the_torch_threads_and_up_the_rollout_workers_that_up_settings_ask_for(tmp_path: Path) -> None:
    config = {"up": {"torch_threads": 2, "rollout_workers": 1}, "trainer": {"checkpoint_every": 0}}
    proc = start_up(tmp_path, "thr", 2, config)
    out = finish(proc, timeout=800)
    assert proc.returncode == 0, out[-4000:]
    run_dir = tmp_path / "thr"
    assert [n for n in json.loads((run_dir / "procs.json").read_text()) if n.startswith("rollout-")] == ["rollout-0"]
    [ready] = events(run_dir / "logs" / "trainer.log", "engine ready")
    assert ready["torch_threads"] == 2, ready
    # the worker waited for its server before pulling, then pulled
    log = run_dir / "logs" / "rollout-0.log"
    assert events(log, "inference servers serving") and events(log, "rollout worker pulling")
    assert left_behind(tmp_path) == []


@pytest.mark.timeout(900)
def test_pin_trainer_runs_the_trainer_and_the_reward_service_on_a_core_and_every_other_service_on_the_rest(tmp_path: Path) -> None:
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("pinning needs 2 cores or more")
    config = {"up": {"pin_trainer": True, "torch_threads": 1}, "trainer": {"checkpoint_every": 0}}
    proc = start_up(tmp_path, "pin", 2, config)
    out = finish(proc, timeout=800)
    assert proc.returncode == 0, out[-4000:]
    logs = tmp_path / "pin" / "logs"
    [ready] = events(logs / "trainer.log", "engine ready")
    [served] = events(logs / "inference-0.log", "ready")
    assert ready["cpus"] == cpus[:1], ready  # what the trainer process itself runs on, as it reports
    assert served["cpus"] == cpus[1:], served
    [scoring] = events(logs / "reward.log", "reward service ready")
    assert scoring["cpus"] == cpus[:1], scoring  # beside the one-thread trainer (up.beside_trainer unset)
    assert left_behind(tmp_path) == []
