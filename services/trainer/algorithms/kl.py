"""Per-token estimators of KL(policy || reference), from samples of the policy.

Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html): with
log r = log p_ref(x) - log p(x) and x sampled from p,
k1 = -log r (unbiased, high variance, can be negative); k2 = (log r)^2 / 2 (biased, low variance);
k3 = (r - 1) - log r (unbiased, low variance, >= 0; GRPO's choice).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (ref_logp - logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """exp(r) - r - 1 with r = ref - logp (>= 0)."""
    r = ref_logp - logp
    return torch.exp(r) - r - 1.0


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(name: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    try:
        fn = KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"kl_estimator {name!r}: expected one of {sorted(KL_ESTIMATORS)}") from None
    return fn(logp, ref_logp)
