"""The AReaL-lite design doc's RLVR example, with the names it leaves undefined (`prompt_str`,
`completions_str`, `res`) filled in as AReaL's own `areal/workflow/rlvr.py` does."""

import asyncio
import uuid

import torch

# the seed: from areal.api.workflow_api import RolloutWorkflow; from areal.api.io_struct import ModelRequest;
# from areal.api.engine_api import InferenceEngine; from tensordict import TensorDict;
# from areal.utils.data import concat_padded_tensors
from jetrl import InferenceEngine, ModelRequest, RolloutWorkflow, TensorDict, concat_padded_tensors


class RLVRWorkflow(RolloutWorkflow):
    def __init__(self, reward_fn, gconfig, tokenizer, enable_thinking=False):
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking

    async def arun_episode(self, engine: InferenceEngine, data):
        input_ids = self.tokenizer.apply_chat_template(
            data["messages"],
            tokenize=True,
            add_generation_prompt=True,
            enable_thinking=self.enable_thinking,
        )

        n_samples = self.gconfig.n_samples
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=input_ids,
            gconfig=self.gconfig.new(n_samples=1),
        )

        # Generate multiple responses concurrently
        resps = await asyncio.gather(*[engine.agenerate(req) for _ in range(n_samples)])

        results = []
        for resp in resps:
            prompt_str = self.tokenizer.decode(resp.input_tokens)
            completions_str = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            reward = self.reward_fn(
                prompt=prompt_str,
                completions=completions_str,
                prompt_ids=resp.input_tokens,
                completion_ids=resp.output_tokens,
                **data,
            )
            seq = resp.input_tokens + resp.output_tokens
            res = dict(
                input_ids=torch.tensor(seq).unsqueeze(0),
                loss_mask=torch.tensor([0] * resp.input_len + [1] * resp.output_len).unsqueeze(0),
                logprobs=torch.tensor([0.0] * resp.input_len + resp.output_logprobs).unsqueeze(0),
                versions=torch.tensor([-1] * resp.input_len + resp.output_versions).unsqueeze(0),
                attention_mask=torch.ones(len(seq), dtype=torch.bool).unsqueeze(0),
                rewards=torch.tensor([float(reward)]),
            )
            results.append(TensorDict(res, batch_size=[1]))

        return concat_padded_tensors(results)
