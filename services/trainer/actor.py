"""`PPOActor`: log-probs, advantages and the (decoupled) PPO update on a `TrainEngine`.

Each rank calls `ppo_update` with its own pieces of the step's mini-batches (see `batch.shard`).
Losses are each rank's share of the global mean, so the update does not depend on the world size.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from services.trainer.batch import attach_advantages, to_tensors
from services.trainer.engine import TrainEngine
from services.trainer.ppo import aggregate, entropy_from_logits, kl_k3, logp_from_logits, ppo_token_loss
from services.trainer.settings import PPOSettings

# Stats summed over mini-batch pieces and ranks; the global means are formed after the all-reduce.
_SUMS = ("loss", "pg_loss", "entropy", "kl", "tokens", "clipped", "capped", "imp_weight")


class PPOActor:
    def __init__(self, engine: TrainEngine, cfg: PPOSettings) -> None:
        self.engine = engine
        self.cfg = cfg

    def compute_logp(self, batch: dict[str, Any], *, reference: bool = False) -> torch.Tensor:
        logits = self.engine.forward(batch, reference=reference)
        return logp_from_logits(logits, batch["input_ids"].long(), self.cfg.temperature).cpu()

    def compute_advantages(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Adds `advantages` (per token) and `sample_advantages` to a collated batch (whole groups)."""
        return attach_advantages(batch, self.cfg.adv_norm, self.cfg.adv_eps)

    def ppo_update(self, pieces: list[dict[str, Any]]) -> dict[str, float]:
        """Train on this rank's pieces (one per mini-batch). Returns global stats (same on every rank)."""
        mbs = [to_tensors(p) for p in pieces]
        # The proximal policy is the current one BEFORE any mini-batch step of this update.
        for mb in mbs:
            if self.cfg.decoupled:
                mb["proximal_logp"] = self.compute_logp(mb)
            if self.cfg.kl_coef > 0:
                mb["ref_logp"] = self.compute_logp(mb, reference=True)
        stats, norms = self.engine.train_batch(mbs, self._loss)
        return self._reduce(stats, norms, len(mbs))

    def _loss(self, logits: torch.Tensor, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.cfg
        ids = mb["input_ids"].long().to(logits.device)
        logp = logp_from_logits(logits, ids, cfg.temperature)
        dev = logp.device
        mask = mb["loss_mask"].to(dev) != 0
        parts = ppo_token_loss(
            logp,
            mb["logprobs"].float().to(dev),
            mb["advantages"].float().to(dev),
            mask,
            eps_clip=cfg.eps_clip,
            proximal_logp=mb["proximal_logp"].to(dev) if cfg.decoupled else None,
            imp_weight_cap=cfg.behav_imp_weight_cap,
        )
        n_tok, n_seq = mb["total_tokens"], mb["total_seqs"]
        pg = aggregate(parts.pg, mask, cfg.loss_agg, n_tok, n_seq)
        ent = aggregate(entropy_from_logits(logits, cfg.temperature), mask, cfg.loss_agg, n_tok, n_seq)
        loss = pg - cfg.entropy_coef * ent
        kl = torch.zeros(())
        if cfg.kl_coef > 0:
            kl = aggregate(kl_k3(logp, mb["ref_logp"].to(dev)), mask, cfg.loss_agg, n_tok, n_seq)
            loss = loss + cfg.kl_coef * kl
        stats = {
            "loss": float(loss.detach()),
            "pg_loss": float(pg.detach()),
            "entropy": float(ent.detach()),
            "kl": float(kl.detach()),
            "tokens": float(mask.sum()),
            "clipped": float(parts.clipped.sum()),
            "capped": float(parts.capped.sum()),
            "imp_weight": float(parts.imp_weight[mask].sum()),
            "imp_weight_max": float(parts.imp_weight[mask].max()) if mask.any() else 0.0,
        }
        # DeepSpeed averages gradients over data-parallel ranks; this rank's loss is its share of the
        # global mean, so scale it back up by the world size.
        return loss * self.engine.world_size, stats

    def _reduce(self, stats: list[dict[str, float]], norms: list[float], n_mb: int) -> dict[str, float]:
        sums = torch.tensor([[s[k] for k in _SUMS] for s in stats], dtype=torch.float64).sum(0)
        top = torch.tensor([max(s["imp_weight_max"] for s in stats)], dtype=torch.float64)
        if self.engine.world_size > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
        total = dict(zip(_SUMS, sums.tolist(), strict=True))
        tokens = max(total["tokens"], 1.0)
        finite = [n for n in norms if math.isfinite(n)]
        return {
            "loss": total["loss"] / n_mb,
            "pg_loss": total["pg_loss"] / n_mb,
            "entropy": total["entropy"] / n_mb,
            "kl": total["kl"] / n_mb,
            "train_tokens": total["tokens"],
            "clip_fraction": total["clipped"] / tokens,
            "imp_weight_capped_fraction": total["capped"] / tokens,
            "imp_weight_mean": total["imp_weight"] / tokens,
            "imp_weight_max": float(top.item()),
            "grad_norm": sum(finite) / len(finite) if finite else float("nan"),
        }
