"""The math of the PPO actor as pure tensor functions: log-probs and entropy here; the advantage
estimators, policy losses, aggregation and KL estimators live in `services.trainer.algorithms` and
are re-exported for the callers of this module; `attach_advantages` is the seed's GRPO advantages on a
collated batch (the built-in algorithm's reference). No engine, no distribution: the unit tests check
these against hand-computed values.

Conventions (the seed API): per-token arrays are aligned with `input_ids`; `logprobs[:, t]` is the
log-prob of token t given tokens < t (0 at t = 0 and on prompt tokens); `loss_mask[:, t]` marks the
generated tokens the loss sees.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from services.trainer.algorithms.advantages import group_advantages
from services.trainer.algorithms.aggregation import aggregate
from services.trainer.algorithms.kl import kl_k3
from services.trainer.algorithms.losses import LossParts, ppo_token_loss

__all__ = ["LossParts", "aggregate", "attach_advantages", "entropy_from_logits", "group_advantages", "kl_k3", "logp_from_logits",
           "ppo_token_loss"]


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


def attach_advantages(batch: dict[str, np.ndarray], mode: str, eps: float) -> dict[str, np.ndarray]:
    """Per-token advantages: each sample's group-normalised advantage on its loss tokens, 0 elsewhere."""
    adv = group_advantages(torch.from_numpy(batch["rewards"]), torch.from_numpy(batch["group_index"]), mode, eps).numpy()
    out = dict(batch)
    out["sample_advantages"] = adv.astype(np.float32)
    out["advantages"] = (adv[:, None] * (batch["loss_mask"] != 0)).astype(np.float32)
    return out
