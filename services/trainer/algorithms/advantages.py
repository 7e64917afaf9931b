"""Built-in advantage estimators (pure tensor functions; the unit tests check them by hand).

- GRPO, Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), eq. in section 4.1.2:
  A_i = (r_i - mean(r)) / std(r) within the group (here the unbiased std, + eps).
- Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
  (arXiv:2503.20783), section 3.1: A_i = r_i - mean(r), without the std division.
- RLOO, Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
  from Human Feedback in LLMs" (arXiv:2402.14740), eq. 7: A_i = r_i - 1/(k-1) sum_{j != i} r_j.
- REINFORCE++, Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
  Models" (arXiv:2501.03262), sections 3.1-3.3: token reward r_t = -beta KL_t, plus the sample
  reward on the last token; return G_t = sum_{s >= t} r_s (gamma = 1); advantages normalised over
  the global batch: (G - mean) / std over all loss tokens.
"""

from __future__ import annotations

import torch


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


def returns_to_go(token_rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """G_t = sum over loss tokens s >= t of r_s (gamma = 1), 0 outside the mask."""
    masked = torch.where(loss_mask, token_rewards.float(), torch.zeros_like(token_rewards, dtype=torch.float32))
    rtg = masked.flip(-1).cumsum(-1).flip(-1)
    return torch.where(loss_mask, rtg, torch.zeros_like(rtg))


def batch_normalise(adv: torch.Tensor, loss_mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(A - mean) / (std + eps) with the mean and the (population) std over every loss token of the
    batch; 0 outside the mask. Per-sample advantages (N,) are spread over each sample's loss tokens first."""
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(loss_mask)
    values = adv[loss_mask]
    if values.numel() == 0:
        return torch.zeros_like(adv, dtype=torch.float32)
    mean = values.mean()
    std = values.std(unbiased=False)
    out = (adv.float() - mean) / (std + eps)
    return torch.where(loss_mask, out, torch.zeros_like(out))


def reinforce_pp(token_rewards: torch.Tensor, loss_mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ per-token advantages: returns-to-go, normalised over the batch's loss tokens."""
    return batch_normalise(returns_to_go(token_rewards, loss_mask), loss_mask, eps)
