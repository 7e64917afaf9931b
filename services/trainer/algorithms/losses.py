"""Built-in per-token policy losses (pure tensor functions; the unit tests check them by hand).

- PPO's clipped surrogate, Schulman et al. 2017 (arXiv:1707.06347), eq. 7, as a loss:
  max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)).
- Decoupled PPO, Fu et al. 2025, "AReaL" (arXiv:2505.24298), eq. 5: the ratio is to the proximal
  policy and each token is weighted by proximal / behaviour; weights over a cap are masked.
- Clip-higher, Yu et al. 2025, "DAPO" (arXiv:2503.14476), eq. 10: separate eps_low and eps_high.
- Dual clip, Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
  Learning" (arXiv:1912.09729), eq. 5: for A < 0 the loss is also bounded by -c A (c > 1).
- GSPO, Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), eqs. 5-7: the
  sequence ratio s_i = exp(1/|y_i| sum_t log(pi(y_t) / pi_old(y_t))) clipped per sequence; every
  token of sequence i carries the sequence's loss, so seq-mean-token-mean gives the paper's mean over
  sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossParts:
    """Per-token terms of the loss, before aggregation (all zero outside the effective mask)."""

    pg: torch.Tensor
    """Policy-gradient loss per token (already importance-weighted when decoupled)."""
    mask: torch.Tensor
    """loss_mask as bool."""
    clipped: torch.Tensor
    """Tokens where a clipped branch (the ratio clip, or the dual clip) was taken."""
    imp_weight: torch.Tensor
    """Behaviour importance weight proximal/behaviour (1 when not decoupled; 0 where capped)."""
    capped: torch.Tensor
    """Loss tokens masked by the importance-weight cap."""
    ratio: torch.Tensor


def clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
                      dual_clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per token, where a clip was taken): the pessimistic of the plain and the clipped ratio,
    and with `dual_clip` = c, for A < 0 no more than -c A."""
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped = loss2 > loss1
    pg = torch.maximum(loss1, loss2)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual = (advantages < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)
        clipped = clipped | dual
    return pg, clipped


def _behaviour_weight(mask: torch.Tensor, old_logp: torch.Tensor, proximal_logp: torch.Tensor | None,
                      cap: float | None, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    capped = torch.zeros_like(mask)
    weight = mask.to(like.dtype)
    if proximal_logp is not None:
        weight = torch.where(mask, torch.exp(proximal_logp - old_logp), torch.zeros_like(like))
        if cap is not None:
            capped = mask & (weight > cap)
            weight = torch.where(capped, torch.zeros_like(weight), weight)
    return weight, capped


def _clipped_parts(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, old_logp: torch.Tensor,
                   proximal_logp: torch.Tensor | None, logp: torch.Tensor, eps: tuple[float, float],
                   dual_clip: float | None, cap: float | None) -> LossParts:
    """What PPO and GSPO share once each has its ratio: the clipped objective, the decoupled behaviour
    weight (proximal / behaviour, capped), and zeros outside the mask."""
    pg, clipped = clipped_objective(ratio, advantages, eps[0], eps[1], dual_clip)
    clipped = clipped & mask
    weight, capped = _behaviour_weight(mask, old_logp, proximal_logp, cap, logp)
    if proximal_logp is not None:
        pg = pg * weight
    pg = torch.where(mask, pg, torch.zeros_like(pg))
    return LossParts(pg=pg, mask=mask, clipped=clipped, imp_weight=weight.detach(), capped=capped, ratio=ratio.detach())


def ppo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    proximal_logp: torch.Tensor | None = None,
    imp_weight_cap: float | None = None,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
) -> LossParts:
    """Clipped PPO per token. With `proximal_logp` (decoupled, AReaL): the ratio is to the proximal
    policy and each token is weighted by exp(proximal - behaviour) = proximal/behaviour, where
    `old_logp` is the behaviour policy; tokens whose weight exceeds the cap get weight 0 (masked).
    `eps_clip_high` (DAPO): the upper clip, else `eps_clip`; `dual_clip`: see `clipped_objective`."""
    mask = loss_mask.bool()
    anchor = proximal_logp if proximal_logp is not None else old_logp
    ratio = torch.where(mask, torch.exp(logp - anchor), torch.zeros_like(logp))
    high = eps_clip if eps_clip_high is None else eps_clip_high
    return _clipped_parts(ratio, advantages, mask, old_logp, proximal_logp, logp,
                          (eps_clip, high), dual_clip, imp_weight_cap)


def gspo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float = 3e-4,
    proximal_logp: torch.Tensor | None = None,
    imp_weight_cap: float | None = None,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
) -> LossParts:
    """GSPO: the length-normalised sequence ratio to the proximal (or behaviour) policy, clipped per
    sequence, broadcast to the sequence's loss tokens. Decoupled weighting as in `ppo_token_loss`."""
    mask = loss_mask.bool()
    anchor = proximal_logp if proximal_logp is not None else old_logp
    log_ratio = torch.where(mask, logp - anchor, torch.zeros_like(logp))
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.where(mask, torch.exp(seq_log_ratio).expand_as(logp), torch.zeros_like(logp))
    high = eps_clip if eps_clip_high is None else eps_clip_high
    return _clipped_parts(ratio, advantages, mask, old_logp, proximal_logp, logp,
                          (eps_clip, high), dual_clip, imp_weight_cap)
