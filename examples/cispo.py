"""A researcher's algorithm in one file: a CISPO-style clipped importance-sampling REINFORCE loss.

CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
arXiv:2506.13585, eq. 4) keeps every token's gradient and clips the importance-sampling weight
instead of the update: the per-token loss is

    -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi(y_t),     r_t = pi(y_t) / pi_behaviour(y_t)

where sg is stop-gradient, so a token PPO's clip would silence still contributes, with a bounded
weight. The advantages are the built-in ones (`Standard`, GRPO by default); this file only replaces
the loss. Train copy3 with it:

    jetrl up --config examples/cispo.yaml

or name it as a file from any config: `trainer: {ppo: {algorithm: "path/to/cispo.py:CISPO"}}`.
"""

from __future__ import annotations

import torch

from jetrl import LossInput, LossOutput, PPOSettings, Standard


class CISPO(Standard):
    def __init__(self, settings: PPOSettings, eps_low: float = 1.0, eps_high: float = 1.0) -> None:
        super().__init__(settings)
        self.eps_low, self.eps_high = eps_low, eps_high

    def loss(self, mb: LossInput) -> LossOutput:
        ratio = torch.exp(mb.logp.detach() - mb.behaviour_logp)
        weight = ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)
        loss = -weight * mb.advantages * mb.logp
        clipped = mb.loss_mask & (weight != ratio)
        return LossOutput(loss=loss, clipped=clipped, imp_weight=weight, extra={"is_ratio": ratio})
