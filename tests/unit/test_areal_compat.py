"""The seeds' (AReaL's) API pieces on their own: staleness over trained tokens, gconfig and the
request/response names, workflow references, interactions with `to_tensor_dict()`, the dump
settings and layout, the version check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from schemas.trajectory import TrajectoryError, decode_group, encode_group_with_meta
from services.common.settings import SettingsError, load_settings
from services.rollout.api import (
    GenerationHyperparameters,
    ModelRequest,
    ModelResponse,
    TensorDict,
    concat_padded_tensors,
)
from services.rollout.dump import TrajectoryDumper
from services.rollout.engine import BadRequestError
from services.rollout.settings import RolloutSettings
from services.rollout.versions import check_versions
from services.rollout.workflow import WorkflowError, as_tensor_dict, import_ref
from services.rollout.workflows.synthetic import SyntheticWorkflow


def seed_example(prompt_version: int = 0) -> dict[str, Any]:
    """The RolloutWorkflow reference's example return value (prompt tokens tagged `prompt_version`)."""
    return {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.int32),
        "attention_mask": torch.ones(1, 5, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0, 0.0, -0.5, -0.3, -0.2]], dtype=torch.float32),
        "rewards": torch.tensor([1.0], dtype=torch.float32),
        "versions": torch.tensor([[prompt_version, prompt_version, 1, 1, 1]], dtype=torch.int32),
    }


# ---------------------------------------------------------------------------- staleness


@pytest.mark.parametrize("prompt_version", [0, -1, 7])
def test_head_version_is_the_oldest_trained_token_whatever_the_prompt_says(prompt_version: int) -> None:
    data, meta = encode_group_with_meta(seed_example(prompt_version), run="r", prompt_id="p", worker="w")
    assert (meta.head_version, meta.tail_version) == (1, 1)
    decoded = decode_group(data)
    assert (decoded.meta.head_version, decoded.meta.tail_version) == (1, 1)


def test_a_trained_token_without_a_version_is_refused_by_name() -> None:
    group = seed_example()
    group["versions"] = torch.tensor([[0, 0, 1, -1, 1]], dtype=torch.int32)
    with pytest.raises(TrajectoryError, match=r"versions: 1 trained tokens \(loss_mask != 0\) have no weight version"):
        encode_group_with_meta(group, run="r", prompt_id="p", worker="w")


def test_the_producing_workflow_travels_in_the_schema_metadata() -> None:
    data, meta = encode_group_with_meta(seed_example(), run="r", prompt_id="p", worker="w", workflow="pkg.mod.MyWorkflow")
    assert meta.workflow == "pkg.mod.MyWorkflow"
    assert decode_group(data).table.schema.metadata[b"workflow"] == b"pkg.mod.MyWorkflow"


def test_dump_versions_count_trained_tokens_only(tmp_path: Path) -> None:
    path = TrajectoryDumper(tmp_path, "exp", "t0").write("42", seed_example(0), is_eval=False)
    assert path == tmp_path / "exp" / "t0" / "rollout" / "1" / "42.jsonl"
    [row] = [json.loads(line) for line in path.read_text().splitlines()]
    assert list(row) == ["task_id", "sample_idx", "seqlen", "prompt_len", "head_version", "tail_version", "reward", "prompt", "completion"]
    assert (row["seqlen"], row["prompt_len"], row["head_version"], row["tail_version"]) == (5, 2, 1, 1)


# ---------------------------------------------------------------------------- the version check


def test_workflow_name_is_what_the_user_wrote_through_the_wrappers() -> None:
    from services.rollout.versions import CheckedWorkflow, workflow_name
    from services.rollout.workflow import GroupedRolloutWorkflow

    wrapped = GroupedRolloutWorkflow(CheckedWorkflow(SyntheticWorkflow()), 2)
    assert workflow_name(wrapped) == "services.rollout.workflows.synthetic.SyntheticWorkflow"


def test_check_versions_names_the_workflow_for_missing_and_invented_versions() -> None:
    check_versions(seed_example(0), "pkg.W", newest_seen=1)
    check_versions(seed_example(0), "pkg.W", newest_seen=-1)  # no reply seen: nothing to compare with
    with pytest.raises(WorkflowError, match=r"workflow pkg\.W: trained tokens carry weight version 1, newer than .* \(0\)"):
        check_versions(seed_example(0), "pkg.W", newest_seen=0)
    group = seed_example(0)
    group["versions"][0, 4] = -1
    with pytest.raises(WorkflowError, match=r"workflow pkg\.W: 1 trained tokens .* have no weight version"):
        check_versions(group, "pkg.W", newest_seen=5)


# ---------------------------------------------------------------------------- requests and responses


def test_gconfig_sets_the_request_and_refuses_what_it_cannot_honour() -> None:
    g = GenerationHyperparameters(n_samples=4, max_new_tokens=8, temperature=0.7, top_p=0.9, stop=["\n"], stop_token_ids=[2])
    one = g.new(n_samples=1)
    assert (one.n_samples, g.n_samples, one.max_new_tokens) == (1, 4, 8)
    req = ModelRequest(rid="r", input_ids=[1, 2, 3], gconfig=one, tokenizer=object())
    sampling = (req.max_new_tokens, req.temperature, req.top_p, req.top_k, req.stop, req.stop_token_ids)
    assert sampling == (8, 0.7, 0.9, 100_000_000, ["\n"], [2])
    assert ModelRequest(input_ids=[1, 2], gconfig=one.new(greedy=True)).temperature == 0.0
    assert ModelRequest(input_ids=[1, 2, 3], gconfig=one.new(max_tokens=5)).max_new_tokens == 2  # prompt + completion <= max_tokens
    with pytest.raises(BadRequestError, match=r"n_samples=4: one request generates one completion"):
        ModelRequest(input_ids=[1], gconfig=g)
    with pytest.raises(BadRequestError, match="lora_name"):
        ModelRequest(input_ids=[1], gconfig=one.new(lora_name="x"))
    assert ModelRequest(input_ids=[1], gconfig=one.new(frequency_penalty=0.5)).frequency_penalty == 0.5  # SGLang serves it
    with pytest.raises(TypeError, match="no field"):
        g.new(n_sample=1)


def test_request_takes_what_apply_chat_template_returns() -> None:
    from transformers import BatchEncoding

    assert ModelRequest(input_ids=BatchEncoding({"input_ids": [1, 5, 6], "attention_mask": [1, 1, 1]})).input_ids == [1, 5, 6]
    assert ModelRequest(input_ids=torch.tensor([4, 5])).input_ids == [4, 5]


def test_response_answers_to_areal_names_too() -> None:
    resp = ModelResponse(input_ids=[1, 2], output_ids=[3], output_logprobs=[-0.1], output_versions=[2], stop_reason="stop",
                         latency_s=0.5, server="s")
    assert (resp.input_tokens, resp.output_tokens, resp.latency, resp.input_len, resp.output_len) == ([1, 2], [3], 0.5, 2, 1)
    resp.output_tokens = [3, 4]
    assert resp.output_ids == [3, 4]


# ---------------------------------------------------------------------------- workflows and results


def test_workflow_refs_in_either_spelling_name_the_same_class() -> None:
    assert import_ref("services.rollout.workflows.synthetic.SyntheticWorkflow") is SyntheticWorkflow
    assert import_ref("services.rollout.workflows.synthetic:SyntheticWorkflow") is SyntheticWorkflow
    assert import_ref("services.rollout.api.TensorDict") is TensorDict
    with pytest.raises(WorkflowError, match="has no attribute 'Missing'"):
        import_ref("services.rollout.workflows.synthetic.Missing")
    with pytest.raises(WorkflowError, match="cannot import module 'nopackage'"):
        import_ref("nopackage.mod.Class")
    s = load_settings(RolloutSettings, None, ["workflow=services.rollout.workflows.synthetic.SyntheticWorkflow"])
    assert s.workflow.endswith(".SyntheticWorkflow")
    with pytest.raises(SettingsError, match=r"expected 'package\.module:ClassName' or"):
        load_settings(RolloutSettings, None, ["workflow=nodots"])


class Interaction:
    """Shaped as AReaL's InteractionWithTokenLogpReward: only `to_tensor_dict()` matters."""

    def __init__(self, n_in: int, out: list[int], reward: float) -> None:
        self.n_in, self.out, self.reward = n_in, out, reward

    def to_tensor_dict(self) -> dict[str, torch.Tensor]:
        n = self.n_in + len(self.out)
        return {
            "input_ids": torch.tensor([list(range(self.n_in)) + self.out], dtype=torch.int32),
            "loss_mask": torch.tensor([[0] * self.n_in + [1] * len(self.out)], dtype=torch.int32),
            "logprobs": torch.tensor([[0.0] * self.n_in + [-0.5] * len(self.out)], dtype=torch.float32),
            "versions": torch.tensor([[-1] * self.n_in + [3] * len(self.out)], dtype=torch.int32),
            "attention_mask": torch.ones(1, n, dtype=torch.bool),
            "rewards": torch.tensor([self.reward], dtype=torch.float32),
        }


def test_interactions_with_to_tensor_dict_become_one_padded_group() -> None:
    t = as_tensor_dict({"chatcmpl-1": Interaction(2, [7, 8, 9], 1.0), "chatcmpl-2": Interaction(3, [5], 0.5)})
    assert t is not None and t["input_ids"].shape == (2, 5)
    assert t["loss_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 0]]
    assert t["rewards"].tolist() == [1.0, 0.5]
    _, meta = encode_group_with_meta(t, run="r", prompt_id="p", worker="w")
    assert (meta.head_version, meta.tail_version) == (3, 3)


def test_tensordict_and_concat_padded_tensors_as_areal_writes_them() -> None:
    a = TensorDict(seed_example(), batch_size=[1])
    with pytest.raises(ValueError, match="batch_size"):
        TensorDict(seed_example(), batch_size=[2])
    b = {k: v[:, :4] if v.dim() == 2 else v for k, v in seed_example().items()}
    out = concat_padded_tensors([a, b])
    assert out["input_ids"].shape == (2, 5) and not bool(out["attention_mask"][1, 4])
    assert np.array_equal(out["versions"][1].numpy(), [0, 0, 1, 1, 0])


# ---------------------------------------------------------------------------- settings


def test_dump_to_file_and_fileroot_as_areal_names_them(tmp_path: Path) -> None:
    s = load_settings(RolloutSettings, None, ["dump_to_file=true", f"fileroot={tmp_path}"])
    assert s.dump_root == str(tmp_path)
    assert load_settings(RolloutSettings, None, [f"fileroot={tmp_path}"]).dump_root is None  # not asked to dump
    assert load_settings(RolloutSettings, None, [f"dump_dir={tmp_path}"]).dump_root == str(tmp_path)  # the older name
    with pytest.raises(SettingsError, match="dump_to_file=true needs fileroot"):
        load_settings(RolloutSettings, None, ["dump_to_file=true"])


def test_the_standard_gconfig_is_one_sample_per_request() -> None:
    g = load_settings(RolloutSettings, None, ["group_size=4", "max_new_tokens=9", "temperature=0.5"]).gconfig
    assert (g.n_samples, g.max_new_tokens, g.temperature) == (1, 9, 0.5)


def test_agent_mode_is_subproc_with_subprocess_kept() -> None:
    from services.rollout.agent.workflow import AgentWorkflow

    class Agent:
        def run(self, data: dict[str, Any]) -> float:
            return 1.0

    assert AgentWorkflow("tests.unit.test_areal_compat:SyncAgent", tokenizer=object(), mode="subproc").mode == "subproc"
    assert AgentWorkflow("tests.unit.test_areal_compat:SyncAgent", tokenizer=object(), mode="subprocess").mode == "subproc"
    with pytest.raises(WorkflowError, match="use mode='subproc'"):
        AgentWorkflow(Agent(), tokenizer=object(), mode="inline")


class SyncAgent:
    def run(self, data: dict[str, Any]) -> float:
        return 1.0


def test_interaction_with_token_logp_reward_is_built_as_areals_code_builds_it() -> None:
    from copy import deepcopy

    from openai.types.chat import ChatCompletion

    from jetrl import InteractionWithTokenLogpReward

    messages = [{"role": "user", "content": "1+1?"}]
    # AReaL's client: messages and chat_template_type at construction, the response and reward later
    first = InteractionWithTokenLogpReward(messages=deepcopy(messages), chat_template_type="concat")
    first.model_response = ModelResponse(input_ids=[1, 5, 6], output_ids=[7, 2], output_logprobs=[-0.5, -0.25],
                                         output_versions=[3, 3], stop_reason="stop", latency_s=0.0, server="s")
    first.output_message_list = [{"role": "assistant", "content": "2"}]
    first.completion = ChatCompletion.model_validate({"id": "c1", "object": "chat.completion", "created": 5, "model": "m",
                                                      "choices": []})
    first.reward = 0.5
    second = InteractionWithTokenLogpReward(
        messages=[*messages, {"role": "assistant", "content": "2"}, {"role": "user", "content": "sure?"}],
        chat_template_type="concat", parent=first, reward=1.0,
        model_response=ModelResponse(input_ids=[1, 5, 6, 7, 2, 8], output_ids=[9], output_logprobs=[-0.1],
                                     output_versions=[4], stop_reason="length", latency_s=0.0, server="s"))
    assert first.interaction_id == "c1" and first.api_type == "completion" and first.created_at == 5.0
    assert second.remaining_messages == [{"role": "user", "content": "sure?"}]
    with pytest.raises(ValueError, match="Cannot set ID"):
        first.interaction_id = "other"
    t = second.to_tensor_dict()  # concat: the parent's sample is the prefix, its trained tokens kept
    assert t["input_ids"].tolist() == [[1, 5, 6, 7, 2, 8, 9]]
    assert t["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 1]]
    assert t["versions"].tolist() == [[-1, -1, -1, 3, 3, -1, 4]]
    assert t["logprobs"][0].tolist() == pytest.approx([0, 0, 0, -0.5, -0.25, 0, -0.1])
    assert t["rewards"].tolist() == [1.0] and t["attention_mask"].dtype == torch.bool
    # AReaL's proxy server: an empty one, filled from a serialized tensor dict and an id
    restored = InteractionWithTokenLogpReward()
    restored._cache = first.to_tensor_dict()
    restored.reward, restored.interaction_id = 0.5, "c1"
    assert restored.has_tensor_data and restored.interaction_id == "c1" and restored.api_type == "none"
    # a workflow returns them as AReaL's does: one padded group, the rewards as set
    group = as_tensor_dict({"c1": first, "c2": second})
    assert group is not None and group["rewards"].tolist() == [0.5, 1.0] and group["input_ids"].shape == (2, 7)
    with pytest.raises(ValueError, match="Model response is not set"):
        InteractionWithTokenLogpReward(messages=messages).to_tensor_dict()
