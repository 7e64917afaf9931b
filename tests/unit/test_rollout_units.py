"""Rollout pieces without a bus: padded tensors, the JSONL dump, settings, workflow construction."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from schemas.trajectory import decode_group, encode_group
from services.common.settings import SettingsError, load_settings
from services.rollout.dump import TrajectoryDumper
from services.rollout.service import build_workflow, worker_config
from services.rollout.settings import RolloutSettings
from services.rollout.tensors import concat_padded, sample_tensors, turn_tensors
from services.rollout.versions import CheckedWorkflow
from services.rollout.workflow import GroupedRolloutWorkflow, WorkflowError
from services.rollout.workflows.synthetic import SyntheticWorkflow


def test_sample_tensors_follow_the_contract_and_survive_the_codec() -> None:
    a = sample_tensors([1, 2, 3], [4, 5], [-0.5, -0.25], [7, 8], reward=1.0)
    b = turn_tensors(
        [([1, 2], False, None, None), ([9], True, [-1.0], [7]), ([3, 3], False, None, None), ([4], True, [-2.0], [8])],
        0.81,
        2,
    )
    group = concat_padded([a, b])
    assert group["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0], [1, 2, 9, 3, 3, 4]]
    assert group["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 1, 0, 0, 1]]
    assert group["versions"].tolist() == [[-1, -1, -1, 7, 8, 0], [-1, -1, 7, -1, -1, 8]]
    assert group["prompt_len"].tolist() == [3, 2]
    decoded = decode_group(encode_group(group, run="r", prompt_id="p", worker="w"))
    for key in ("input_ids", "loss_mask", "versions", "logprobs", "rewards", "attention_mask"):
        assert np.array_equal(decoded.tensors[key], group[key].numpy()), key
    assert (decoded.meta.head_version, decoded.meta.tail_version) == (7, 8)


def test_sample_tensors_refuse_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="same length"):
        sample_tensors([1], [2, 3], [-1.0], [0, 0], reward=0.0)
    with pytest.raises(ValueError, match="keys"):
        concat_padded([sample_tensors([1], [2], [-1.0], [0], 0.0), {"input_ids": torch.zeros(1, 1)}])


def test_dump_writes_one_line_per_sample_under_the_versioned_path(tmp_path: Path) -> None:
    group = concat_padded([sample_tensors([1, 2], [3], [-0.1], [4], 0.5), sample_tensors([1, 2], [3, 3], [-0.1, -0.2], [5, 6], 1.0)])
    dumper = TrajectoryDumper(tmp_path, "exp", "t1", decode=lambda ids: "".join(chr(96 + i) for i in ids))
    path = dumper.write("task/7", group, is_eval=True)
    assert path == tmp_path / "exp" / "t1" / "eval-rollout" / "4" / "task_7.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[1] == {
        "task_id": "task/7", "sample_idx": 1, "seqlen": 4, "prompt_len": 2, "head_version": 5, "tail_version": 6,
        "reward": 1.0, "prompt": "ab", "completion": "cc",
    }
    assert rows[0]["completion"] == "c" and rows[0]["seqlen"] == 3


def test_settings_validate_and_name_the_bad_key() -> None:
    s = load_settings(RolloutSettings, None, ["run=x", "max_concurrent=4", "workflow_kwargs.delay_s=0.5", "inference.servers=[http://h:1]"])
    assert s.max_concurrent == 4 and s.workflow_kwargs == {"delay_s": 0.5} and s.inference.servers == ["http://h:1"]
    assert s.experiment_name == "x" and s.worker  # hostname-pid by default
    with pytest.raises(SettingsError, match="max_deliver"):
        load_settings(RolloutSettings, None, ["max_deliver=0"])
    with pytest.raises(SettingsError, match="unknown key"):
        load_settings(RolloutSettings, None, ["max_concurency=3"])


def test_episode_timeout_defaults_to_a_bound_reaches_the_worker_and_refuses_negatives() -> None:
    assert RolloutSettings().episode_timeout_s == 1800  # a hanging workflow is bounded out of the box
    s = load_settings(RolloutSettings, None, ["episode_timeout_s=0"])  # 0 = no limit
    assert worker_config(s).episode_timeout_s == 0
    assert worker_config(load_settings(RolloutSettings, None, ["episode_timeout_s=90"])).episode_timeout_s == 90
    with pytest.raises(SettingsError, match="episode_timeout_s"):
        load_settings(RolloutSettings, None, ["episode_timeout_s=-1"])


def test_build_workflow_injects_standard_arguments_and_groups_single_sample_workflows() -> None:
    made: list[str] = []
    standard = {"group_size": lambda: 5, "tokenizer": lambda: made.append("tok")}
    s = RolloutSettings(workflow="services.rollout.workflows.synthetic:SyntheticWorkflow", workflow_kwargs={"delay_s": 0.1})
    wf = build_workflow(s, standard)
    assert isinstance(wf, CheckedWorkflow) and isinstance(wf.workflow, SyntheticWorkflow)  # versions checked
    assert wf.group_size == 5 and wf.delay_s == 0.1
    assert made == []  # the tokenizer is never loaded for a workflow that does not take one
    s2 = RolloutSettings(workflow="tests.unit.test_workflow:LengthWorkflow", group_size=3)
    grouped = build_workflow(s2, standard)
    assert isinstance(grouped, GroupedRolloutWorkflow) and grouped.group_size == 3


def test_build_workflow_gives_areal_workflows_a_gconfig_the_config_can_change() -> None:
    from services.rollout.gconfig import GenerationHyperparameters

    s = RolloutSettings(workflow="tests.seed_workflows.rollout_workflow.MyWorkflow", group_size=4, max_new_tokens=7,
                        workflow_kwargs={"gconfig": {"temperature": 0.3}})
    wf = build_workflow(s, {"tokenizer": lambda: "tok", "group_size": lambda: 4})
    # the seed's constructor takes **kwargs but not group_size by name: the worker makes the group
    assert isinstance(wf, GroupedRolloutWorkflow) and wf.group_size == 4
    inner = wf.workflow.workflow
    assert inner.gconfig == GenerationHyperparameters(n_samples=1, max_new_tokens=7, temperature=0.3) and inner.tokenizer == "tok"
    with pytest.raises(WorkflowError, match=r"workflow_kwargs\.gconfig: .*no field"):
        build_workflow(RolloutSettings(workflow=s.workflow, workflow_kwargs={"gconfig": {"nsamples": 2}}), {})
