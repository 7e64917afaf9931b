"""Reward shaping applied by the trainer before any algorithm's advantages.

- Scale, bias and clip: r' = clip(scale x (r + bias), -c, c), the reward scaling and clipping of
  Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients" (arXiv:2005.12729), with a
  fixed scale (the batch statistics are the advantage normalisation's job).
- Overlong reward shaping, Yu et al. 2025, "DAPO" (arXiv:2503.14476), eq. 13: with L = response
  length, R_length = 0 if L <= L_max - L_cache; ((L_max - L_cache) - L) / L_cache if
  L_max - L_cache < L <= L_max; -1 if L > L_max; added to the reward (times a penalty factor).
- KL in the reward (REINFORCE++, arXiv:2501.03262, eq. 4): each loss token's reward is
  -beta x KL_t, the sample's reward is added on its last loss token.
"""

from __future__ import annotations

import torch

from services.trainer.settings import PPOSettings


def scale_rewards(rewards: torch.Tensor, scale: float = 1.0, bias: float = 0.0, clip: float | None = None) -> torch.Tensor:
    out = (rewards.float() + bias) * scale
    return out.clamp(-clip, clip) if clip is not None else out


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (<= 0) for responses of `lengths` tokens."""
    start = max_tokens - buffer
    soft = (start - lengths.float()) / float(buffer)
    out = torch.where(lengths > start, soft, torch.zeros_like(soft))
    return torch.where(lengths > max_tokens, torch.full_like(soft, -1.0), out) * penalty


def shaped_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor, cfg: PPOSettings) -> torch.Tensor:
    """Scale, bias, clip, then the overlong penalty (response length = the sample's loss tokens)."""
    out = scale_rewards(rewards, cfg.reward_scale, cfg.reward_bias, cfg.reward_clip)
    if cfg.overlong_max_tokens is not None:
        out = out + overlong_penalty(loss_mask.sum(-1), cfg.overlong_max_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
    return out


def token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor, kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """(N, T): minus `kl_penalty` (already times its coefficient) on loss tokens, plus each sample's
    reward on its last loss token (a sample without loss tokens keeps it on token 0)."""
    n, t = loss_mask.shape
    out = torch.zeros(n, t, dtype=torch.float32)
    if kl_penalty is not None:
        out = torch.where(loss_mask, -kl_penalty.float(), out)
    positions = torch.arange(t).expand(n, t)
    last = torch.where(loss_mask, positions, torch.zeros_like(positions)).max(-1).values
    out[torch.arange(n), last] += rewards.float()
    return out
