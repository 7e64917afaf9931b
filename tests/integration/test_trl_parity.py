"""Learning parity with TRL: one update of jetrl's trainer (DeepSpeed ZeRO-2 engine, the built-in
GRPO algorithm at the demo's settings) on an on-policy copy3 batch moves the weights as TRL's
GRPOTrainer does on the same batch (its own loss function, AdamW and gradient clip), so any gap
in steps to a reward between the two is sampling noise, not the update.

The two differ in one documented constant only: TRL adds 1e-4 to the group std, jetrl `ppo.adv_eps`
(1e-6 by default), set to 1e-4 here. Skipped without TRL (the optional extra `.[peer]`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("trl")

GROUPS, GROUP, NEW_TOKENS, LR = 8, 8, 4, 1e-3


def _sample(model: Any, tok: Any, seed: int) -> tuple[list[dict[str, Any]], list[list[int]], list[list[int]], list[float]]:
    """On-policy copy3 groups sampled from `model` (behaviour log-probs = the model's own), as jetrl
    collates them, and the same samples as TRL sees them (prompt ids, completion ids, rewards)."""
    import torch

    from services.common.demo_task import copy3_reward

    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    groups, prompts, completions, rewards = [], [], [], []
    for _ in range(GROUPS):
        digits = "".join(rng.choice(list("0123456789"), 3))
        prompt = [tok.bos_token_id, *tok(f"{digits}=", add_special_tokens=False).input_ids]
        ids = torch.tensor([prompt] * GROUP)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                nxt = torch.multinomial(torch.softmax(model(ids).logits[:, -1].float(), -1), 1, generator=gen)
                ids = torch.cat([ids, nxt], 1)
        width = len(prompt) + NEW_TOKENS
        arr, att, lm = (np.zeros((GROUP, width), np.int64) for _ in range(3))
        group_rewards = []
        for i, row in enumerate(ids.tolist()):
            c = row[len(prompt):]
            c = c[: c.index(tok.eos_token_id) + 1] if tok.eos_token_id in c else c
            end = len(prompt) + len(c)
            arr[i, :end], att[i, :end], lm[i, len(prompt):end] = prompt + c, 1, 1
            group_rewards.append(copy3_reward(tok.decode(c, skip_special_tokens=True), digits))
            prompts.append(prompt)
            completions.append(c)
        with torch.no_grad():
            logits = model(torch.from_numpy(arr), attention_mask=torch.from_numpy(att)).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.from_numpy(arr[:, 1:, None])).squeeze(-1)
        logprobs = np.zeros(arr.shape, np.float32)
        logprobs[:, 1:] = lp.numpy() * lm[:, 1:]
        groups.append({"input_ids": arr, "attention_mask": att, "loss_mask": lm, "logprobs": logprobs,
                       "rewards": np.array(group_rewards, np.float32), "versions": np.where(lm > 0, 0, -1)})
        rewards += group_rewards
    return groups, prompts, completions, rewards


def _trl_update(model_path: Path, tok: Any, prompts: list[list[int]], completions: list[list[int]], rewards: list[float],
                out: Path) -> dict[str, Any]:
    """TRL's own loss (`GRPOTrainer._compute_loss`), its own optimizer, and the clip its Trainer applies."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import nanstd

    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=GROUPS * GROUP, num_generations=GROUP, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_completion_length=NEW_TOKENS,
        temperature=1.0, epsilon=0.2, entropy_coef=0.03, loss_type="dapo", scale_rewards="group", beta=0.0, num_iterations=1,
        max_steps=1, save_strategy="no", report_to="none", seed=0, use_cpu=True, bf16=False, disable_tqdm=True,
    )
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "123="}]}] * GROUPS)
    def no_reward(completions: list[Any], **_: Any) -> list[float | None]:  # the rewards are given below
        return [0.0] * len(completions)

    trainer = GRPOTrainer(model=policy, reward_funcs=no_reward, args=config, train_dataset=data, processing_class=tok)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    model: Any = trainer.model
    optimizer: Any = trainer.optimizer
    trainer.current_gradient_accumulation_steps = 1
    completion_ids = torch.full((len(completions), NEW_TOKENS), tok.pad_token_id)
    completion_mask = torch.zeros(len(completions), NEW_TOKENS, dtype=torch.long)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c)] = torch.tensor(c)
        completion_mask[i, : len(c)] = 1
    r = torch.tensor(rewards).view(-1, GROUP)  # TRL's advantages, as in _generate_and_score_completions
    advantages = ((r - r.mean(1, keepdim=True)) / (nanstd(r, dim=1).unsqueeze(1) + 1e-4)).flatten()
    prompt_ids = torch.tensor(prompts)
    model.train()
    loss = trainer._compute_loss(model, {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": advantages, "num_items_in_batch": completion_mask.sum(),
    })
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    optimizer.step()
    return {"loss": float(loss.detach()), "grad_norm": float(norm),
            "weights": {k: v.detach().clone() for k, v in model.named_parameters()}}


def test_one_update_on_the_same_batch_moves_the_weights_as_trl_does(tiny_model: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.trainer.intake.batch import collate, shard
    from services.trainer.model.actor import PPOActor
    from services.trainer.model.engine import TrainEngine
    from services.trainer.settings import TrainerSettings

    tok = AutoTokenizer.from_pretrained(tiny_model)
    start = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    groups, prompts, completions, rewards = _sample(start, tok, seed=0)
    assert 0 < sum(rewards) < len(rewards), "the batch must carry a learning signal"

    settings = TrainerSettings(model_path=str(tiny_model), seed=0, lr=LR, ppo={"adv_eps": 1e-4, "entropy_coef": 0.03})
    engine = TrainEngine(settings)
    actor = PPOActor(engine, settings.ppo)
    stats = actor.ppo_update(shard(actor.compute_advantages(collate(groups)), 1, 1)[0])
    ours = engine.full_state_dict()
    assert ours is not None
    theirs = _trl_update(tiny_model, tok, prompts, completions, rewards, tmp_path / "trl")

    assert stats["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
    before = dict(start.named_parameters())
    ours_step = torch.cat([(ours[k] - before[k]).flatten() for k in theirs["weights"]])
    their_step = torch.cat([(v - before[k]).flatten() for k, v in theirs["weights"].items()])
    assert their_step.norm() > 0
    # Adam's first step is ~lr x sign(gradient) per weight, so a weight whose gradient is ~0 may step
    # either way in float32: compare the whole update, not each weight
    gap = float((ours_step - their_step).norm() / their_step.norm())
    assert gap < 1e-3, f"jetrl's update differs from TRL's by {gap:.2e} of its size"
