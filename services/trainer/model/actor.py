"""`PPOActor`: log-probs, advantages and the (decoupled) PPO update on a `TrainEngine`, through the
configured algorithm (`ppo.algorithm`, default the settings-driven `Standard`).

Each rank calls `ppo_update` with its own pieces of the step's mini-batches (see `batch.shard`).
Losses are each rank's share of the global mean, so the update does not depend on the world size.

The proximal policy (decoupled PPO) is the policy before the update's first optimizer step. For the
first mini-batch that is the live policy itself: its training forward's log-probs, detached, are the
proximal ones, so no separate no-grad forward runs for it. That holds only while the training forward
is the no-grad forward's function (no active dropout: `stochastic_forward`); otherwise, or with
`ppo.recompute_proximal`, every micro-batch gets its own no-grad forward before the first step.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from services.common.logging import get_logger
from services.trainer.algorithms.calls import attach_advantages, checked_loss, loss_input
from services.trainer.algorithms.kl import kl_estimate
from services.trainer.algorithms.registry import load_algorithm
from services.trainer.model.engine import TrainEngine
from services.trainer.model.fused_head import head_logp_entropy, head_rows_logp_entropy, output_head
from services.trainer.model.logprobs import lean_logp_entropy, logp_entropy_from_logits, rows_logp_entropy
from services.trainer.model.packing import KEY, target_ids, tree_of, unpack
from services.trainer.model.ppo import aggregate
from services.trainer.model.prompt_tree import scatter
from services.trainer.settings import PPOSettings

log = get_logger("trainer.actor")

# Stats summed over mini-batch pieces and ranks; the global means are formed after the all-reduce.
_SUMS = ("loss", "pg_loss", "entropy", "kl", "tokens", "clipped", "capped", "imp_weight")
_REF_CHUNK = 64
"""Samples per reference forward pass when rank 0 computes KL-in-reward for the whole batch."""


class PPOActor:
    def __init__(self, engine: TrainEngine, cfg: PPOSettings) -> None:
        self.engine = engine
        self.cfg = cfg
        # Loaded on every rank at start-up: a bad `ppo.algorithm` fails before any step.
        self.algorithm = load_algorithm(cfg)
        # Why the first mini-batch's proximal log-probs need their own forward (None: they are the
        # training forward's). Decided once, from the model: the same on every rank, so ZeRO-3's
        # collective forward passes stay matched.
        self.recompute_reason: str | None = None
        if cfg.decoupled:
            self.recompute_reason = "ppo.recompute_proximal" if cfg.recompute_proximal else stochastic_forward(engine.engine.module)
            log.info("proximal log-probs", first_minibatch="recomputed" if self.recompute_reason else "reused from the training forward",
                     reason=self.recompute_reason)
        # The output projection folded into the chunked log-prob function (None: log-probs from the
        # model's logits). Decided once, the same on every rank.
        self.head: torch.nn.Linear | None = None
        settings = engine.settings
        if settings.logp_chunk_tokens > 0 and settings.fused_output_projection:
            self.head, why_not = output_head(engine.engine.module, engine.stage)
            if why_not is not None:
                log.info("fused output projection off: log-probs from the model's logits, chunked", reason=why_not)

    def compute_logp(self, batch: dict[str, Any], *, reference: bool = False) -> torch.Tensor:
        """Per-token log-probs (rows x length, the padded layout even when `batch` is packed), on the CPU."""
        return self._device_logp(batch, reference=reference).cpu()

    def _device_logp(self, batch: dict[str, Any], *, reference: bool = False) -> torch.Tensor:
        """`compute_logp` left on the engine's device, where the loss reads it (no round trip)."""
        fused = self.head is not None and not reference
        out = self.engine.forward(batch, reference=reference, hidden=fused)
        with torch.no_grad():  # fused, the output projection's weight is an input that requires grad
            return self._logp_entropy(out, batch, entropy=False, fused=fused)[0]

    def _logp_entropy(self, logits: torch.Tensor, mb: dict[str, Any], *, entropy: bool = True,
                      fused: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logp, entropy or None) in `mb`'s padded layout: chunked with `logp_chunk_tokens` (from the
        last hidden states through `self.head` when it is set and `fused`: then `logits` are those
        hidden states), else the whole-vocabulary way; computed on the packed row when `mb` is packed,
        then put back."""
        chunk, temp = self.engine.settings.logp_chunk_tokens, self.cfg.temperature
        if tree_of(mb) is not None:
            return self._tree_logp_entropy(logits, mb, entropy=entropy, fused=fused)
        ids = target_ids(mb).long().to(logits.device)
        ent: torch.Tensor | None
        if fused and self.head is not None:
            logp, ent = head_logp_entropy(logits, self.head.weight, self.head.bias, ids, temp, chunk,
                                          keep_mb=self.engine.settings.fused_keep_probs_mb, into_grad=self.engine.grads_in_params)
        elif chunk > 0:
            logp, ent = lean_logp_entropy(logits, ids, temp, chunk)
        else:
            logp, ent = logp_entropy_from_logits(logits, ids, temp, entropy=entropy)
        return unpack(logp, mb), unpack(ent, mb) if ent is not None and entropy else None

    def _tree_logp_entropy(self, logits: torch.Tensor, mb: dict[str, Any], *, entropy: bool,
                           fused: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_logp_entropy` of a row packed with shared prompts: the outputs at the positions that
        predict answer tokens only (services.trainer.model.prompt_tree), then put in the padded layout."""
        tree, shape = tree_of(mb), mb[KEY].shape
        assert tree is not None
        chunk, temp = self.engine.settings.logp_chunk_tokens, self.cfg.temperature
        rows = logits.reshape(-1, logits.shape[-1]).index_select(0, tree.src.to(logits.device))
        if fused and self.head is not None:
            logp, ent = head_rows_logp_entropy(rows, self.head.weight, self.head.bias, tree.targets, temp, chunk,
                                               keep_mb=self.engine.settings.fused_keep_probs_mb, into_grad=self.engine.grads_in_params)
        else:
            logp, ent = rows_logp_entropy(rows, tree.targets, temp, chunk)
        return scatter(logp, tree, shape), scatter(ent, tree, shape) if entropy else None

    def compute_advantages(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Adds `advantages` (per token) and `sample_advantages` to a collated batch (whole groups),
        via the algorithm; with kl_in=reward the reference log-probs are computed here first (rank 0
        only: the reference model is a plain module on every rank, not a collective)."""
        ref = None
        if self.cfg.kl_in == "reward" and self.cfg.kl_coef > 0:
            ref = self._reference_logp(batch)
        return attach_advantages(self.algorithm, batch, self.cfg, ref)

    def _reference_logp(self, batch: dict[str, np.ndarray]) -> torch.Tensor:
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        assert self.engine.ref_model is not None
        with self.engine.ref_model.on_device():
            self._reference_chunks(batch, out)
        return out

    def _reference_chunks(self, batch: dict[str, np.ndarray], out: torch.Tensor) -> None:
        n = batch["input_ids"].shape[0]
        for start in range(0, n, _REF_CHUNK):
            rows = slice(start, start + _REF_CHUNK)
            length = int(batch["attention_mask"][rows].sum(-1).max())
            chunk = to_tensors({k: batch[k][rows, :length] for k in ("input_ids", "attention_mask")})
            out[rows, :length] = self.compute_logp(chunk, reference=True)

    def ppo_update(self, pieces: list[dict[str, Any]]) -> dict[str, float]:
        """Train on this rank's pieces (one per mini-batch). Returns global stats (same on every rank)."""
        mbs = [self.engine.micro_batches(to_tensors(p)) for p in pieces]
        # The proximal policy is the current one BEFORE any mini-batch step of this update: computed
        # now for the mini-batches after the first; the first one's is its own training forward's
        # (None here, filled in by `_loss`) unless that forward is stochastic.
        flat = [m for micros in mbs for m in micros]
        if self.cfg.decoupled:
            for i, micros in enumerate(mbs):
                for mb in micros:
                    mb["proximal_logp"] = None if i == 0 and self.recompute_reason is None else self._device_logp(mb)
        ref = self.engine.ref_model
        if ref is not None and self.cfg.kl_in == "loss":
            with ref.on_device():  # reference_placement cpu: moved to the device once for these passes
                for mb in flat:
                    mb["ref_logp"] = self._device_logp(mb, reference=True)
        stats, norms = self.engine.train_batch(mbs, self._loss, hidden=self.head is not None)
        return self._reduce(stats, norms, len(mbs))

    def _loss(self, logits: torch.Tensor, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        logp, entropy = self._logp_entropy(logits, mb)
        assert entropy is not None
        if cfg.decoupled and mb["proximal_logp"] is None:
            # No optimizer step yet: the policy of this forward is the proximal one (see ppo_update).
            mb = {**mb, "proximal_logp": logp.detach()}
        inp = loss_input(mb, logp, cfg)
        out = checked_loss(self.algorithm, inp)
        mask = inp.loss_mask
        n_tok, n_seq, norm = mb["total_tokens"], mb["total_seqs"], cfg.loss_agg_norm
        pg = aggregate(out.loss, mask, cfg.loss_agg, n_tok, n_seq, norm)
        ent = aggregate(entropy, mask, cfg.loss_agg, n_tok, n_seq, norm)
        loss = pg - cfg.entropy_coef * ent
        kl = torch.zeros((), device=mask.device)
        if inp.ref_logp is not None:
            kl = aggregate(kl_estimate(cfg.kl_estimator, logp, inp.ref_logp), mask, cfg.loss_agg, n_tok, n_seq, norm)
            loss = loss + cfg.kl_coef * kl
        weight = (out.imp_weight if out.imp_weight is not None else mask.float()).detach()
        none = torch.zeros((), dtype=torch.float64, device=mask.device)
        # Float64 scalars left on the device: reading each (float(), .item(), a boolean index) would
        # wait for the device once per stat and micro-batch; `_reduce` reads them all at once.
        stats = {
            "loss": loss.detach().double(),
            "pg_loss": pg.detach().double(),
            "entropy": ent.detach().double(),
            "kl": kl.detach().double(),
            "tokens": mask.sum().double(),
            "clipped": (out.clipped & mask).sum().double() if out.clipped is not None else none,
            "capped": (out.capped & mask).sum().double() if out.capped is not None else none,
            "imp_weight": _masked_sum(weight, mask),
            "imp_weight_max": torch.where(mask.any(), torch.where(mask, weight, -math.inf).amax().double(), none),
        }
        for name, value in sorted(out.extra.items()):
            stats[f"algo_{name}"] = _masked_sum(value.detach(), mask)
        # DeepSpeed averages gradients over data-parallel ranks; this rank's loss is its share of the
        # global mean, so scale it back up by the world size.
        return loss * self.engine.world_size, stats

    def _reduce(self, stats: list[dict[str, torch.Tensor]], norms: list[float], n_mb: int) -> dict[str, float]:
        # The algorithm's own per-token stats; ranks agree on the names first, so an algorithm that
        # reports a stat on some pieces only cannot make the all-reduce shapes differ.
        names: set[str] = {k for s in stats for k in s if k.startswith("algo_")}
        if self.engine.world_size > 1:
            everyone: list[Any] = [None] * self.engine.world_size
            dist.all_gather_object(everyone, sorted(names))
            names = set().union(*everyone)
        keys = (*_SUMS, *sorted(names))
        # On the device (NCCL reduces device tensors only); read back once, after the reductions.
        dev = self.engine.device
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        sums = torch.stack([torch.stack([s.get(k, zero).to(dev) for k in keys]) for s in stats]).sum(0)
        top = torch.stack([s["imp_weight_max"].to(dev) for s in stats]).amax().reshape(1)
        if self.engine.world_size > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
        *values, top_value = torch.cat([sums, top]).tolist()
        total = dict(zip(keys, values, strict=True))
        tokens = max(total["tokens"], 1.0)
        finite = [n for n in norms if math.isfinite(n)]
        algo = {k: v / tokens for k, v in total.items() if k.startswith("algo_")}
        return algo | {
            "loss": total["loss"] / n_mb,
            "pg_loss": total["pg_loss"] / n_mb,
            "entropy": total["entropy"] / n_mb,
            "kl": total["kl"] / n_mb,
            "train_tokens": total["tokens"],
            "clip_fraction": total["clipped"] / tokens,
            "imp_weight_capped_fraction": total["capped"] / tokens,
            "imp_weight_mean": total["imp_weight"] / tokens,
            "imp_weight_max": top_value,
            "grad_norm": sum(finite) / len(finite) if finite else float("nan"),
        }


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` on the mask, in float64, without a boolean index (which reads the mask back)."""
    return torch.where(mask, values.float(), 0.0).double().sum()


def stochastic_forward(module: torch.nn.Module) -> str | None:
    """Why `module`'s training forward may differ from its no-grad (eval) forward, or None when it is
    the same function: dropout (a dropout module with p > 0, LoRA's included, or a dropout / drop
    probability in the model config, which attention kernels read in training mode), router jitter,
    batch statistics. Conservative: a named probability > 0 counts even if this model ignores it."""
    configs: dict[int, Any] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
            return f"{name or 'model'} is {type(sub).__name__}(p={sub.p})"
        if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
            return f"{name or 'model'} is {type(sub).__name__} (batch statistics in training)"
        config = getattr(sub, "config", None)
        if hasattr(config, "to_dict"):
            configs.setdefault(id(config), config)
    for config in configs.values():
        found = _random_config(config.to_dict())
        if found is not None:
            return found
    return None


def _random_config(config: dict[str, Any], prefix: str = "config.") -> str | None:
    for key, value in config.items():
        if isinstance(value, dict):
            found = _random_config(value, f"{prefix}{key}.")
            if found is not None:
                return found
        elif (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
              and any(word in key.lower() for word in ("dropout", "pdrop", "layerdrop", "drop_path", "jitter"))):
            return f"{prefix}{key}={value}"
    return None


def to_tensors(piece: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v for k, v in piece.items()}
