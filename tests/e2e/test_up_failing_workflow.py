"""`jetrl up` with a workflow that fails every episode stops within `rollout.fail_fast_after`, with
the exception, the workflow's name and the failure counts on screen, instead of burning the dataset."""

from __future__ import annotations

from pathlib import Path

from tests.support.up import finish, left_behind, start_up


def test_up_stops_when_every_episode_fails_with_the_exception_on_screen(tmp_path: Path) -> None:
    config = {"rollout": {"workflow": "tests.e2e.failing_workflow:PromptIdsWorkflow", "fail_fast_after": 8,
                          "max_deliver": 2, "nak_delay_s": 0.1, "group_size": 2},
              "trainer": {"checkpoint_every": 0}}
    proc = start_up(tmp_path, "e2e-fail", 5, config)
    out = finish(proc, timeout=300)
    assert proc.returncode == 1, out[-3000:]
    assert "service rollout-0 exited with code 1" in out, out[-3000:]
    # the error, readable: what failed, in which workflow, with its traceback
    assert "EpisodesFailing: workflow tests.e2e.failing_workflow.PromptIdsWorkflow" in out, out[-3000:]
    assert "KeyError: 'prompt_ids'" in out and "Traceback (most recent call last)" in out, out[-3000:]
    assert "failures by type: {'KeyError': " in out
    # the summary counts what failed, by type, instead of saying only "no trainer step was recorded"
    assert "rollout: episodes failed" in out and "(KeyError " in out, out[-3000:]
    assert not left_behind(tmp_path)
