"""The RolloutWorkflow reference's "create a custom workflow" example, with its two helpers written
out as the same page's tensor-dict example does it: prompt tokens tagged version 0, int32 ids and
masks, a bool attention mask."""

import uuid

import torch

# the seed: from areal.api.workflow_api import RolloutWorkflow (and ModelRequest from areal.api.io_struct)
from jetrl import ModelRequest, RolloutWorkflow
from tests.seed_workflows.rewards import copy3_reward_fn


class MyWorkflow(RolloutWorkflow):
    def __init__(self, tokenizer, gconfig, **kwargs):
        self.tokenizer = tokenizer
        self.gconfig = gconfig

    async def arun_episode(self, engine, data):
        # 1. Prepare input
        input_ids = self.tokenizer.encode(data["prompt"])
        # 2. Generate completion
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=input_ids,
            gconfig=self.gconfig,
            tokenizer=self.tokenizer,
        )
        resp = await engine.agenerate(req)
        # 3. Compute reward
        reward = self.compute_reward(resp, data)
        # 4. Return tensor dict (or None to reject)
        if reward < 0:
            return None
        return self.build_tensor_dict(resp, reward)

    def compute_reward(self, resp, data):
        completion = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        return copy3_reward_fn(data["prompt"], completion, resp.input_tokens, resp.output_tokens, answer=data["answer"])

    def build_tensor_dict(self, resp, reward):
        n_in, n_out = len(resp.input_tokens), len(resp.output_tokens)
        return {
            "input_ids": torch.tensor([resp.input_tokens + resp.output_tokens], dtype=torch.int32),
            "attention_mask": torch.ones(1, n_in + n_out, dtype=torch.bool),
            "loss_mask": torch.tensor([[0] * n_in + [1] * n_out], dtype=torch.int32),
            "logprobs": torch.tensor([[0.0] * n_in + resp.output_logprobs], dtype=torch.float32),
            "rewards": torch.tensor([reward], dtype=torch.float32),
            "versions": torch.tensor([[0] * n_in + resp.output_versions], dtype=torch.int32),
        }


class FutureVersionsWorkflow(MyWorkflow):
    """The same, but tagging every token with a version of its own invention (newer than any)."""

    def build_tensor_dict(self, resp, reward):
        res = super().build_tensor_dict(resp, reward)
        res["versions"] = torch.full_like(res["versions"], 99)
        return res
