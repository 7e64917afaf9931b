"""The math of the PPO actor as pure tensor functions: log-probs, group advantages, the decoupled
PPO loss. No engine, no distribution: the unit tests check these against hand-computed values.

Conventions (the seed API): per-token arrays are aligned with `input_ids`; `logprobs[:, t]` is the
log-prob of token t given tokens < t (0 at t = 0 and on prompt tokens); `loss_mask[:, t]` marks the
generated tokens the loss sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def logp_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of each token under `logits / temperature`, aligned with `input_ids` (0 at t = 0)."""
    logp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return F.pad(picked, (1, 0), value=0.0)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution that produced each token, aligned like `logp_from_logits`."""
    logp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return F.pad(ent, (1, 0), value=0.0)


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, mode: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages normalised within each group.

    grpo: (r - mean) / (std + eps) with the unbiased std (as GRPO); drgrpo: r - mean; rloo: r minus
    the mean of the group's other samples, i.e. G/(G-1) * (r - mean). A group of one gets 0.
    """
    rewards = rewards.float()
    n_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    count = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group_index, torch.ones_like(rewards))
    total = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group_index, rewards)
    mean = (total / count)[group_index]
    centered = rewards - mean
    g = count[group_index]
    if mode == "drgrpo":
        adv = centered
    elif mode == "rloo":
        adv = torch.where(g > 1, centered * g / (g - 1).clamp(min=1), torch.zeros_like(centered))
    elif mode == "grpo":
        sq = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group_index, centered * centered)
        std = (sq / (count - 1).clamp(min=1)).sqrt()[group_index]
        adv = centered / (std + eps)
    else:
        raise ValueError(f"adv_norm {mode!r}: expected grpo, drgrpo or rloo")
    return torch.where(g > 1, adv, torch.zeros_like(adv))


@dataclass
class LossParts:
    """Per-token terms of the loss, before aggregation (all zero outside the effective mask)."""

    pg: torch.Tensor
    """Policy-gradient loss per token (already importance-weighted when decoupled)."""
    mask: torch.Tensor
    """loss_mask as bool."""
    clipped: torch.Tensor
    """Tokens where the clipped branch was taken."""
    imp_weight: torch.Tensor
    """Behaviour importance weight proximal/behaviour (1 when not decoupled; 0 where capped)."""
    capped: torch.Tensor
    """Loss tokens masked by the importance-weight cap."""
    ratio: torch.Tensor


def ppo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    proximal_logp: torch.Tensor | None = None,
    imp_weight_cap: float | None = None,
) -> LossParts:
    """Clipped PPO per token. With `proximal_logp` (decoupled, AReaL): the ratio is to the proximal
    policy and each token is weighted by exp(proximal - behaviour) = proximal/behaviour, where
    `old_logp` is the behaviour policy; tokens whose weight exceeds the cap get weight 0 (masked)."""
    mask = loss_mask.bool()
    anchor = proximal_logp if proximal_logp is not None else old_logp
    ratio = torch.where(mask, torch.exp(logp - anchor), torch.zeros_like(logp))
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip)
    loss1 = -advantages * ratio
    loss2 = -advantages * clipped_ratio
    clipped = (loss2 > loss1) & mask
    pg = torch.maximum(loss1, loss2)
    capped = torch.zeros_like(mask)
    weight = mask.to(logp.dtype)
    if proximal_logp is not None:
        weight = torch.where(mask, torch.exp(proximal_logp - old_logp), torch.zeros_like(logp))
        if imp_weight_cap is not None:
            capped = mask & (weight > imp_weight_cap)
            weight = torch.where(capped, torch.zeros_like(weight), weight)
        pg = pg * weight
    pg = torch.where(mask, pg, torch.zeros_like(pg))
    return LossParts(pg=pg, mask=mask, clipped=clipped, imp_weight=weight.detach(), capped=capped, ratio=ratio.detach())


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, total_tokens: float, total_seqs: float) -> torch.Tensor:
    """Sum this shard's contribution to a global mean: token-mean divides the masked sum by the global
    token count; seq-mean averages within each sequence, then divides by the global sequence count.
    Dividing by global counts makes a sum over shards (ranks, mini-batch pieces) the exact global mean."""
    masked = torch.where(mask, per_token, torch.zeros_like(per_token))
    if mode == "token-mean":
        return masked.sum() / max(total_tokens, 1.0)
    if mode == "seq-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(total_seqs, 1.0)
    raise ValueError(f"loss_agg {mode!r}: expected token-mean or seq-mean")


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference) per token: exp(r) - r - 1 with r = ref - logp (>= 0)."""
    r = ref_logp - logp
    return torch.exp(r) - r - 1.0
