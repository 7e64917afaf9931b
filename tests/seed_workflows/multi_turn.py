"""AReaL's `MultiTurnWorkflow` as the asynchronous-rollout seed describes it: `n_samples` episodes
at once, each retrying with feedback until the reward is positive or the turns run out.

Two lines read `req.input_ids` where AReaL's read `input_ids`: under transformers 5,
`apply_chat_template(tokenize=True)` returns a BatchEncoding, which `ModelRequest` unwraps but `+`
and `decode` do not."""

import asyncio
import uuid

import torch

# the seed: from areal.api.workflow_api import RolloutWorkflow; from areal.api.io_struct import ModelRequest;
# from areal.api.engine_api import InferenceEngine; from tensordict import TensorDict;
# from areal.utils.data import concat_padded_tensors
from jetrl import InferenceEngine, ModelRequest, RolloutWorkflow, TensorDict, concat_padded_tensors


class MultiTurnWorkflow(RolloutWorkflow):
    def __init__(self, reward_fn, gconfig, tokenizer, max_turns, turn_discount):
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.multi_turn_prompt_ids = tokenizer.encode("wrong answer try again:", add_special_tokens=False)

    async def _run_one_episode(self, engine: InferenceEngine, data, rid):
        seq, logprobs, loss_mask, versions = [], [], [], []
        messages = data["messages"]
        input_ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        t = reward = 0
        discount = 1
        while reward == 0 and t < self.max_turns:
            req = ModelRequest(
                rid=rid,
                input_ids=input_ids,
                gconfig=self.gconfig.new(n_samples=1),
                tokenizer=self.tokenizer,
            )
            resp = await engine.agenerate(req)
            prompt_str = self.tokenizer.decode(req.input_ids)
            completions_str = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            reward = self.reward_fn(prompt_str, completions_str, resp.input_tokens, resp.output_tokens, **data)
            input_len = len(resp.input_tokens) - len(seq)
            seq += resp.input_tokens[-input_len:] + resp.output_tokens
            logprobs += [0.0] * input_len + resp.output_logprobs
            loss_mask += [0] * input_len + [1] * resp.output_len
            versions += [-1] * input_len + resp.output_versions
            t += 1
            if reward == 0 and t < self.max_turns:
                input_ids = req.input_ids + resp.output_tokens
                if resp.output_tokens[-1] != self.tokenizer.eos_token_id:
                    input_ids += [self.tokenizer.eos_token_id]
                input_ids += self.multi_turn_prompt_ids
                discount *= self.turn_discount
        reward = float(reward * discount)
        res = dict(
            input_ids=torch.tensor(seq),
            logprobs=torch.tensor(logprobs),
            loss_mask=torch.tensor(loss_mask, dtype=torch.bool),
            versions=torch.tensor(versions),
            rewards=torch.tensor(reward),
            attention_mask=torch.ones(len(seq), dtype=torch.bool),
        )
        res = {k: v.unsqueeze(0) for k, v in res.items()}
        return TensorDict(res, batch_size=[1]), prompt_str, completions_str, reward, len(seq)

    async def arun_episode(self, engine: InferenceEngine, data):
        tasks = [self._run_one_episode(engine, data, uuid.uuid4().hex) for _ in range(self.gconfig.n_samples)]
        results = await asyncio.gather(*tasks)
        return concat_padded_tensors([res[0] for res in results])
