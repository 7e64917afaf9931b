"""How the trainer calls an algorithm: builds its inputs from a collated batch or a mini-batch piece,
applies what stays the trainer's (reward shaping, KL in the reward, masking), and checks what comes
back, naming the algorithm when it breaks the contract."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from services.trainer.algorithms.api import AdvantageInput, Algorithm, LossInput, LossOutput
from services.trainer.algorithms.kl import kl_estimate
from services.trainer.algorithms.rewards import shaped_rewards, token_rewards
from services.trainer.intake.columns import extra_columns
from services.trainer.settings import PPOSettings


class AlgorithmContractError(RuntimeError):
    """An algorithm returned something the trainer cannot use; the message says what."""


def advantage_input(batch: dict[str, np.ndarray], cfg: PPOSettings, ref_logprobs: torch.Tensor | None = None) -> AdvantageInput:
    """`ref_logprobs`: the reference model's log-probs of the batch, needed with kl_in=reward."""
    raw = torch.from_numpy(np.ascontiguousarray(batch["rewards"])).float()
    mask = torch.from_numpy(np.ascontiguousarray(batch["loss_mask"])) != 0
    logprobs = torch.from_numpy(np.ascontiguousarray(batch["logprobs"])).float()
    rewards = shaped_rewards(raw, mask, cfg)
    penalty = None
    if cfg.kl_in == "reward" and cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("ppo.kl_in=reward needs the reference log-probs of the batch")
        penalty = cfg.kl_coef * torch.where(mask, kl_estimate(cfg.kl_estimator, logprobs, ref_logprobs.float()), torch.zeros_like(logprobs))
    per_token = token_rewards(rewards, mask, penalty)
    columns = {k: torch.from_numpy(np.ascontiguousarray(batch[k])) for k in extra_columns(batch)}
    return AdvantageInput(
        rewards=per_token.sum(-1), token_rewards=per_token, raw_rewards=raw,
        group_index=torch.from_numpy(np.ascontiguousarray(batch["group_index"])), loss_mask=mask, logprobs=logprobs,
        ref_logprobs=ref_logprobs if penalty is not None else None, columns=columns, settings=cfg,
    )


def attach_advantages(algorithm: Algorithm, batch: dict[str, np.ndarray], cfg: PPOSettings,
                      ref_logprobs: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """Adds `advantages` (N, T; 0 off the loss mask) and `sample_advantages` (N,: per-token ones
    averaged over the sample's loss tokens) to a collated batch."""
    inp = advantage_input(batch, cfg, ref_logprobs)
    adv = algorithm.advantages(inp)
    n, t = inp.loss_mask.shape
    if not isinstance(adv, torch.Tensor) or adv.shape not in ((n,), (n, t)):
        got = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
        raise AlgorithmContractError(f"{_name(algorithm)}.advantages returned {got}; expected a tensor shaped ({n},) or ({n}, {t})")
    adv = adv.detach().float()
    if not torch.isfinite(adv[inp.loss_mask] if adv.dim() == 2 else adv).all():
        raise AlgorithmContractError(f"{_name(algorithm)}.advantages returned NaN or inf")
    mask = inp.loss_mask
    if adv.dim() == 1:
        sample = adv
        per_token = adv[:, None] * mask
    else:
        per_token = torch.where(mask, adv, torch.zeros_like(adv))
        sample = per_token.sum(-1) / mask.sum(-1).clamp(min=1)
    out = dict(batch)
    out["sample_advantages"] = sample.numpy().astype(np.float32)
    out["advantages"] = per_token.numpy().astype(np.float32)
    return out


def loss_input(mb: dict[str, Any], logp: torch.Tensor, cfg: PPOSettings) -> LossInput:
    dev = logp.device
    mask = mb["loss_mask"].to(dev) != 0
    return LossInput(
        logp=logp,
        proximal_logp=mb["proximal_logp"].to(dev) if cfg.decoupled else None,
        behaviour_logp=mb["logprobs"].float().to(dev),
        advantages=mb["advantages"].float().to(dev),
        loss_mask=mask,
        ref_logp=mb["ref_logp"].to(dev) if "ref_logp" in mb else None,
        columns={k: mb[k].to(dev) for k in extra_columns(mb) if isinstance(mb[k], torch.Tensor)},
        settings=cfg,
    )


def checked_loss(algorithm: Algorithm, inp: LossInput) -> LossOutput:
    out = algorithm.loss(inp)
    if not isinstance(out, LossOutput):
        raise AlgorithmContractError(f"{_name(algorithm)}.loss returned {type(out).__name__}; expected a LossOutput")
    if out.loss.shape != inp.logp.shape:
        raise AlgorithmContractError(f"{_name(algorithm)}.loss: loss shaped {tuple(out.loss.shape)}; expected {tuple(inp.logp.shape)}")
    return out


def _name(algorithm: Algorithm) -> str:
    return type(algorithm).__name__
