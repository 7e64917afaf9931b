"""Each built-in algorithm against its paper's formula, on inputs small enough to compute by hand."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from services.trainer.algorithms import (
    Standard,
    aggregate,
    gspo_token_loss,
    kl_estimate,
    overlong_penalty,
    ppo_token_loss,
    scale_rewards,
    shaped_rewards,
)
from services.trainer.algorithms.calls import advantage_input, attach_advantages
from services.trainer.model.ppo import attach_advantages as seed_attach_advantages
from services.trainer.settings import PPOSettings

LOG = math.log


def _batch(rewards: list[float], groups: list[int], loss_mask: list[list[int]],
           logprobs: list[list[float]] | None = None) -> dict[str, np.ndarray]:
    mask = np.array(loss_mask, dtype=np.int8)
    return {
        "input_ids": np.ones(mask.shape, np.int64), "attention_mask": np.ones(mask.shape, np.int64), "loss_mask": mask,
        "logprobs": np.array(logprobs, np.float32) if logprobs is not None else np.zeros(mask.shape, np.float32),
        "versions": np.zeros(mask.shape, np.int64), "rewards": np.array(rewards, np.float32),
        "group_index": np.array(groups, np.int64),
    }


# ----------------------------------------------------------------------------------- advantages

def test_default_advantages_are_the_seed_grpo_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    batch = _batch(rng.random(12).tolist(), [0] * 4 + [1] * 4 + [2] * 4, (rng.random((12, 6)) > 0.4).astype(int).tolist())
    for mode in ("grpo", "drgrpo", "rloo"):
        cfg = PPOSettings(adv_norm=mode)
        ours = attach_advantages(Standard(cfg), batch, cfg)
        seed = seed_attach_advantages(batch, mode, cfg.adv_eps)
        assert np.array_equal(ours["advantages"], seed["advantages"]), mode
        assert np.array_equal(ours["sample_advantages"], seed["sample_advantages"]), mode


def test_grpo_through_the_algorithm() -> None:
    # one group, rewards 1, 0, 0, 1: mean 0.5, unbiased std sqrt(1/3)
    cfg = PPOSettings()
    out = attach_advantages(Standard(cfg), _batch([1, 0, 0, 1], [0] * 4, [[0, 1]] * 4), cfg)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert out["sample_advantages"].tolist() == pytest.approx([a, -a, -a, a], rel=1e-6)
    assert out["advantages"][:, 0].tolist() == [0, 0, 0, 0]


def test_rloo_leaves_one_out() -> None:
    cfg = PPOSettings(adv_norm="rloo")
    out = attach_advantages(Standard(cfg), _batch([1, 0, 0, 1], [0] * 4, [[1]] * 4), cfg)
    # r_i - mean of the 3 others: 1 - 1/3, 0 - 2/3
    assert out["sample_advantages"].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], rel=1e-6)


def test_reinforce_pp_returns_with_kl_in_the_reward_normalised_over_the_batch() -> None:
    # k1 = behaviour - reference per token: sample 0 (0.5, -0.5, 0) on tokens 1..3, sample 1 (-1, 0) on tokens 1..2
    behaviour = [[0, -1, -1, -1], [0, -2, -2, 0]]
    reference = torch.tensor([[0, -1.5, -0.5, -1], [0, -1, -2, 0]])
    batch = _batch([1.0, 0.0], [0, 1], [[0, 1, 1, 1], [0, 1, 1, 0]], behaviour)
    cfg = PPOSettings(adv_norm="reinforce++", kl_coef=0.1, kl_estimator="k1", kl_in="reward", adv_eps=1e-8)
    inp = advantage_input(batch, cfg, reference)
    # token rewards: -0.1 * k1, plus the reward on the last loss token
    assert inp.token_rewards.flatten().tolist() == pytest.approx([0, -0.05, 0.05, 1.0, 0, 0.1, 0, 0], abs=1e-6)
    assert inp.rewards.tolist() == pytest.approx([1.0, 0.1], abs=1e-6)
    # returns-to-go (gamma 1): sample 0 (1.0, 1.05, 1.0), sample 1 (0.1, 0.0); then batch whitening
    returns = [1.0, 1.05, 1.0, 0.1, 0.0]
    mean, std = statistics.fmean(returns), statistics.pstdev(returns)
    out = attach_advantages(Standard(cfg), batch, cfg, reference)
    mask = batch["loss_mask"] != 0
    assert out["advantages"][mask].tolist() == pytest.approx([(g - mean) / std for g in returns], rel=1e-5)
    assert out["advantages"][~mask].tolist() == [0, 0, 0]


def test_batch_normalisation_after_a_group_estimator() -> None:
    cfg = PPOSettings(adv_norm="drgrpo", adv_batch_norm=True, adv_eps=1e-8)
    # drgrpo: (0.5, -0.5) in group 0, (1, -1) in group 1; sample 3 has 2 loss tokens, the others 1
    out = attach_advantages(Standard(cfg), _batch([1, 0, 2, 0], [0, 0, 1, 1], [[1, 0], [1, 0], [1, 0], [1, 1]]), cfg)
    tokens = [0.5, -0.5, 1.0, -1.0, -1.0]
    mean, std = statistics.fmean(tokens), statistics.pstdev(tokens)
    mask = out["loss_mask"] != 0
    assert out["advantages"][mask].tolist() == pytest.approx([(t - mean) / std for t in tokens], rel=1e-5)


# -------------------------------------------------------------------------------- reward shaping

def test_reward_scale_bias_and_clip() -> None:
    # clip(0.5 * (r + 1), -1, 1): 2 -> 1.5 -> 1; -3 -> -1; 0.5 -> 0.75
    assert scale_rewards(torch.tensor([2.0, -3.0, 0.5]), 0.5, 1.0, 1.0).tolist() == [1.0, -1.0, 0.75]
    assert scale_rewards(torch.tensor([2.0]), 0.5, 1.0, None).tolist() == [1.5]


def test_dapo_overlong_penalty() -> None:
    # L_max 10, L_cache 4: no penalty up to 6, linear to -1 at 10, -1 beyond
    lengths = torch.tensor([5, 6, 8, 10, 11])
    assert overlong_penalty(lengths, 10, 4).tolist() == pytest.approx([0, 0, -0.5, -1.0, -1.0])
    assert overlong_penalty(lengths, 10, 4, penalty=0.5).tolist() == pytest.approx([0, 0, -0.25, -0.5, -0.5])
    cfg = PPOSettings(overlong_max_tokens=4, overlong_buffer=2, reward_scale=2.0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]).bool()  # lengths 3 and 5
    assert shaped_rewards(torch.tensor([1.0, 1.0]), mask, cfg).tolist() == pytest.approx([2.0 - 0.5, 2.0 - 1.0])


# ------------------------------------------------------------------------------------- the loss

def test_dapo_clip_higher_separates_the_low_and_high_epsilon() -> None:
    logp = torch.log(torch.tensor([[1.25, 1.35, 0.75, 0.85]]))  # ratios to an old log-prob of 0
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    parts = ppo_token_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), eps_clip=0.2, eps_clip_high=0.28)
    # 1.25 < 1.28 unclipped; 1.35 -> 1.28; A < 0, 0.75 -> 0.8 (pessimistic); 0.85 unclipped
    assert parts.pg.tolist()[0] == pytest.approx([-1.25, -1.28, 0.8, 0.85], rel=1e-6)
    assert parts.clipped.tolist()[0] == [False, True, True, False]


def test_dual_clip_bounds_the_loss_of_negative_advantages() -> None:
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0]]))
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    parts = ppo_token_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), eps_clip=0.2, dual_clip=3.0)
    # A<0, r=5: max(5, 1.2) = 5 -> min(5, 3) = 3; A<0, r=2: 2 < 3 stays; A>0, r=5: -1.2 as PPO
    assert parts.pg.tolist()[0] == pytest.approx([3.0, 2.0, -1.2], rel=1e-6)
    assert parts.clipped.tolist()[0] == [True, False, True]
    plain = ppo_token_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), eps_clip=0.2)
    assert plain.pg.tolist()[0] == pytest.approx([5.0, 2.0, -1.2], rel=1e-6)


def test_gspo_clips_the_length_normalised_sequence_ratio() -> None:
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.3, 9.0], [-0.3, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    parts = gspo_token_loss(logp, old, adv, mask, eps_clip=0.2)
    # s_0 = exp((0.1 + 0.3) / 2) = 1.2214 > 1.2 -> -1.2 (clipped); s_1 = exp(-0.3 / 3) = 0.9048 -> 0.9048
    s1 = math.exp(-0.1)
    assert parts.pg.detach().flatten().tolist() == pytest.approx([-1.2, -1.2, 0.0, s1, s1, s1], rel=1e-5)
    assert parts.clipped.tolist() == [[True, True, False], [False, False, False]]
    # seq-mean-token-mean gives the paper's mean over sequences; the gradient flows through s_1 only
    loss = aggregate(parts.pg, mask, "seq-mean-token-mean", 5, 2)
    assert float(loss.detach()) == pytest.approx((-1.2 + s1) / 2, rel=1e-5)
    loss.backward()
    assert logp.grad is not None
    # d/dlogp_t of (-A s_1 / 2) = s_1 / 3 / 2 per token of sequence 1
    assert logp.grad[1].tolist() == pytest.approx([s1 / 6] * 3, rel=1e-5)
    assert logp.grad[0].tolist() == [0.0, 0.0, 0.0]


def test_standard_loss_selects_gspo_and_the_clip_settings() -> None:
    from services.trainer.algorithms import LossInput

    logp = torch.log(torch.tensor([[1.35, 1.0]]))
    mask = torch.tensor([[True, False]])
    mb = LossInput(logp=logp, proximal_logp=None, behaviour_logp=torch.zeros(1, 2), advantages=torch.ones(1, 2),
                   loss_mask=mask, ref_logp=None, columns={}, settings=PPOSettings())
    ppo = Standard(PPOSettings(decoupled=False, eps_clip_high=0.28)).loss(mb)
    assert ppo.loss.tolist()[0] == pytest.approx([-1.28, 0.0])
    gspo = Standard(PPOSettings(decoupled=False, policy_loss="gspo", eps_clip=0.1)).loss(mb)
    assert gspo.loss.tolist()[0] == pytest.approx([-1.1, 0.0])


# ------------------------------------------------------------------------------- KL and aggregation

def test_kl_estimators_k1_k2_k3() -> None:
    logp, ref = torch.tensor(LOG(0.5)), torch.tensor(LOG(0.25))
    # log r = log(p_ref / p) = -log 2
    assert float(kl_estimate("k1", logp, ref)) == pytest.approx(LOG(2))
    assert float(kl_estimate("k2", logp, ref)) == pytest.approx(LOG(2) ** 2 / 2)
    assert float(kl_estimate("k3", logp, ref)) == pytest.approx(0.5 - 1 + LOG(2))
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate("k4", logp, ref)


def test_kl_in_the_reward_with_the_k3_estimator() -> None:
    batch = _batch([1.0], [0], [[0, 1]], [[0, LOG(0.5)]])
    cfg = PPOSettings(kl_coef=0.5, kl_in="reward", kl_estimator="k3")
    inp = advantage_input(batch, cfg, torch.tensor([[0, LOG(0.25)]]))
    k3 = 0.5 - 1 + LOG(2)
    assert inp.token_rewards.tolist()[0] == pytest.approx([0, 1.0 - 0.5 * k3])
    assert inp.raw_rewards.tolist() == [1.0]


def test_loss_aggregations() -> None:
    per_token = torch.tensor([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert float(aggregate(per_token, mask, "token-mean", 3, 2)) == pytest.approx(8 / 3)
    assert float(aggregate(per_token, mask, "seq-mean-token-mean", 3, 2)) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(per_token, mask, "seq-mean-token-sum", 3, 2)) == pytest.approx((4 + 4) / 2)
    # Dr.GRPO: token sums over a constant (here 10) instead of each length, then the mean over sequences
    assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm", 3, 2, norm=10)) == pytest.approx((0.4 + 0.4) / 2)
    with pytest.raises(ValueError, match="loss_agg_norm"):
        aggregate(per_token, mask, "seq-mean-token-sum-norm", 3, 2)


def test_aggregates_over_shards_sum_to_the_global_value() -> None:
    g = torch.Generator().manual_seed(1)
    per_token, mask = torch.randn(6, 5, generator=g), torch.rand(6, 5, generator=g) > 0.3
    mask[:, 0] = True
    tokens, seqs = float(mask.sum()), 6.0
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        whole = aggregate(per_token, mask, mode, tokens, seqs, norm=7.0)
        parts = sum(aggregate(per_token[i:i + 2], mask[i:i + 2], mode, tokens, seqs, norm=7.0) for i in (0, 2, 4))
        assert float(parts) == pytest.approx(float(whole), rel=1e-5), mode
