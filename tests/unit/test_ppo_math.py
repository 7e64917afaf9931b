"""The PPO actor's math against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.trainer.intake.batch import collate, shard
from services.trainer.model.ppo import (
    aggregate,
    attach_advantages,
    entropy_from_logits,
    group_advantages,
    kl_k3,
    logp_from_logits,
    ppo_token_loss,
)

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 3.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1])


def test_grpo_advantages_divide_by_the_unbiased_group_std() -> None:
    adv = group_advantages(REWARDS, GROUPS, "grpo", eps=0.0)
    # group 0: mean 0.5, centered (0.5, -0.5, 0, 0), unbiased var 0.5/3; group 1: mean 7/3, var (1/9+1/9+4/9)/2
    std0, std1 = math.sqrt(0.5 / 3), math.sqrt((6 / 9) / 2)
    expected = [0.5 / std0, -0.5 / std0, 0, 0, (-1 / 3) / std1, (-1 / 3) / std1, (2 / 3) / std1]
    assert adv.tolist() == pytest.approx(expected, rel=1e-5)


def test_drgrpo_advantages_only_subtract_the_group_mean() -> None:
    adv = group_advantages(REWARDS, GROUPS, "drgrpo")
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0, 0, -1 / 3, -1 / 3, 2 / 3], rel=1e-5)


def test_rloo_advantages_leave_one_out() -> None:
    adv = group_advantages(REWARDS, GROUPS, "rloo")
    # r_i - mean(others): 1 - 1/3, 0 - 2/3, 0.5 - 0.5, ..., 2 - 2.5, 2 - 2.5, 3 - 2
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, 0, 0, -0.5, -0.5, 1.0], rel=1e-5)


def test_equal_rewards_and_singleton_groups_give_zero_advantage() -> None:
    for mode in ("grpo", "drgrpo", "rloo"):
        adv = group_advantages(torch.tensor([0.3, 0.3, 1.0]), torch.tensor([0, 0, 1]), mode)
        assert adv.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="adv_norm"):
        group_advantages(REWARDS, GROUPS, "ppo")


def test_clipped_loss_takes_the_pessimistic_branch() -> None:
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5, 1.1]]))  # ratios 1, 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0]])
    parts = ppo_token_loss(logp, old, adv, torch.ones(1, 4), eps_clip=0.2)
    # A>0, r=1.5: min(1.5, 1.2)*A -> loss -1.2 (clipped); A<0, r=0.5: max(-0.5*-1, -0.8*-1) -> 0.8 (clipped)
    assert parts.pg.tolist()[0] == pytest.approx([-1.0, -1.2, 0.8, 2.2], rel=1e-6)
    assert parts.clipped.tolist()[0] == [False, True, True, False]
    assert float(aggregate(parts.pg, parts.mask, "token-mean", 4, 1)) == pytest.approx((-1.0 - 1.2 + 0.8 + 2.2) / 4)


def test_masked_tokens_contribute_nothing() -> None:
    logp = torch.tensor([[0.3, -0.2, 0.1]])
    parts = ppo_token_loss(logp, torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([[0, 1, 0]]))
    assert parts.pg.tolist()[0][0] == 0 and parts.pg.tolist()[0][2] == 0 and parts.ratio[0, 0] == 0


def test_decoupled_loss_equals_plain_ppo_when_proximal_is_behaviour() -> None:
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(3, 6, generator=g) * 0.3, torch.randn(3, 6, generator=g) * 0.3
    adv, mask = torch.randn(3, 6, generator=g), (torch.rand(3, 6, generator=g) > 0.3)
    plain = ppo_token_loss(logp, old, adv, mask, eps_clip=0.2)
    decoupled = ppo_token_loss(logp, old, adv, mask, eps_clip=0.2, proximal_logp=old.clone(), imp_weight_cap=5.0)
    assert torch.allclose(plain.pg, decoupled.pg)
    assert float(aggregate(plain.pg, mask, "token-mean", float(mask.sum()), 3)) == pytest.approx(
        float(aggregate(decoupled.pg, mask, "token-mean", float(mask.sum()), 3)))


def test_decoupled_loss_weights_by_proximal_over_behaviour_and_caps() -> None:
    behaviour = torch.log(torch.tensor([[0.5, 0.1, 0.4, 0.2]]))
    proximal = torch.log(torch.tensor([[0.5, 0.6, 0.2, 0.2]]))  # weights 1, 6, 0.5, 1
    logp = proximal.clone()  # ratio to proximal 1: no clipping
    adv = torch.ones(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]])
    parts = ppo_token_loss(logp, behaviour, adv, mask, proximal_logp=proximal, imp_weight_cap=5.0)
    assert parts.capped.tolist()[0] == [False, True, False, False]  # only the loss token over the cap
    assert parts.imp_weight.tolist()[0] == pytest.approx([1.0, 0.0, 0.5, 0.0])
    assert parts.pg.tolist()[0] == pytest.approx([-1.0, 0.0, -0.5, 0.0])
    uncapped = ppo_token_loss(logp, behaviour, adv, mask, proximal_logp=proximal, imp_weight_cap=None)
    assert uncapped.pg.tolist()[0] == pytest.approx([-1.0, -6.0, -0.5, 0.0])


def test_seq_mean_averages_within_then_across_sequences() -> None:
    per_token = torch.tensor([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert float(aggregate(per_token, mask, "seq-mean", 3, 2)) == pytest.approx((2.0 + 4.0) / 2)
    assert float(aggregate(per_token, mask, "token-mean", 3, 2)) == pytest.approx(8.0 / 3)


def test_logp_and_entropy_are_aligned_with_the_tokens() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(3.0), 0.0], [0.0, 0.0]]])
    ids = torch.tensor([[0, 1, 0]])
    lp = logp_from_logits(logits, ids)
    assert lp.tolist()[0] == pytest.approx([0.0, math.log(0.75), math.log(0.75)])
    assert logp_from_logits(logits, ids, temperature=1e9).tolist()[0][1] == pytest.approx(math.log(0.5), abs=1e-6)
    ent = entropy_from_logits(logits)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert ent.tolist()[0] == pytest.approx([0.0, h, h])
    assert float(kl_k3(torch.tensor(0.0), torch.tensor(0.0))) == 0.0 and float(kl_k3(torch.tensor(-1.0), torch.tensor(0.0))) > 0


def test_shards_cover_every_sample_once_with_global_counts() -> None:
    groups = []
    for g in range(3):
        ids = np.arange(20, dtype=np.int64).reshape(4, 5) + g
        lm = np.zeros_like(ids)
        lm[:, 2 + g % 2:] = 1
        groups.append({"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": lm,
                       "logprobs": np.zeros(ids.shape, np.float32), "versions": np.zeros_like(ids),
                       "rewards": np.arange(4, dtype=np.float32)})
    batch = attach_advantages(collate(groups), "drgrpo", 1e-6)
    assert batch["advantages"][0].tolist() == [0, 0, -1.5, -1.5, -1.5]
    parts = shard(batch, world_size=2, n_minibatches=2)
    assert len(parts) == 2 and all(len(p) == 2 for p in parts)
    for mb in range(2):
        tokens = sum(float((p[mb]["loss_mask"] != 0).sum()) for p in parts)
        assert all(p[mb]["total_tokens"] == tokens for p in parts)
    firsts = np.concatenate([p[mb]["input_ids"][:, 0] for mb in range(2) for p in parts])
    assert sorted(firsts.tolist()) == sorted(batch["input_ids"][:, 0].tolist())
    with pytest.raises(ValueError, match="batch_groups"):
        shard(batch, world_size=8, n_minibatches=2)
