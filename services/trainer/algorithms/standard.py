"""`Standard`: the built-in algorithm, configured by `PPOSettings` (the default is GRPO advantages
with AReaL's decoupled PPO loss). A researcher's algorithm may subclass it and replace one method."""

from __future__ import annotations

import torch

from services.trainer.algorithms.advantages import batch_normalise, group_advantages, reinforce_pp
from services.trainer.algorithms.api import AdvantageInput, LossInput, LossOutput
from services.trainer.algorithms.losses import gspo_token_loss, ppo_token_loss
from services.trainer.settings import PPOSettings

POLICY_LOSSES = {"ppo": ppo_token_loss, "gspo": gspo_token_loss}
ADVANTAGE_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce++")


class Standard:
    """Advantages per `ppo.adv_norm` (+ `adv_batch_norm`), loss per `ppo.policy_loss` with
    `eps_clip`, `eps_clip_high`, `dual_clip`, `decoupled` and `behav_imp_weight_cap`."""

    def __init__(self, settings: PPOSettings) -> None:
        self.settings = settings

    def advantages(self, batch: AdvantageInput) -> torch.Tensor:
        cfg = self.settings
        if cfg.adv_norm == "reinforce++":
            return reinforce_pp(batch.token_rewards, batch.loss_mask, cfg.adv_eps)
        adv = group_advantages(batch.rewards, batch.group_index, cfg.adv_norm, cfg.adv_eps)
        if cfg.adv_batch_norm:
            return batch_normalise(adv, batch.loss_mask, cfg.adv_eps)
        return adv

    def loss(self, mb: LossInput) -> LossOutput:
        cfg = self.settings
        parts = POLICY_LOSSES[cfg.policy_loss](
            mb.logp, mb.behaviour_logp, mb.advantages, mb.loss_mask,
            eps_clip=cfg.eps_clip, proximal_logp=mb.proximal_logp, imp_weight_cap=cfg.behav_imp_weight_cap,
            eps_clip_high=cfg.eps_clip_high, dual_clip=cfg.dual_clip,
        )
        return LossOutput(loss=parts.pg, clipped=parts.clipped, capped=parts.capped, imp_weight=parts.imp_weight)
