"""Loss aggregation: per-token loss -> this shard's share of the mini-batch's loss.

Each mode divides by global counts (the mini-batch's loss tokens or sequences over every rank and
piece), so a sum over shards is exactly the loss of the whole mini-batch:
- token-mean: sum over all loss tokens / tokens (DAPO's token-level loss, arXiv:2503.14476 eq. 12);
- seq-mean-token-mean (alias seq-mean): mean within each sequence, then over sequences (GRPO's
  1/G sum_i 1/|o_i| sum_t, arXiv:2402.03300 eq. 3);
- seq-mean-token-sum: sum within each sequence, mean over sequences;
- seq-mean-token-sum-norm: sum within each sequence / a constant, mean over sequences (Dr.GRPO's
  constant normaliser in place of 1/|o_i|, arXiv:2503.20783 section 3.1).
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, total_tokens: float, total_seqs: float,
              norm: float | None = None) -> torch.Tensor:
    """Sum this shard's contribution to the global aggregate (`norm`: the seq-mean-token-sum-norm constant)."""
    masked = torch.where(mask, per_token, torch.zeros_like(per_token))
    seqs = max(total_seqs, 1.0)
    if mode == "token-mean":
        return masked.sum() / max(total_tokens, 1.0)
    if mode in ("seq-mean", "seq-mean-token-mean"):
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / seqs
    if mode == "seq-mean-token-sum":
        return masked.sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        if norm is None:
            raise ValueError("loss_agg seq-mean-token-sum-norm needs a constant normaliser (ppo.loss_agg_norm)")
        return masked.sum() / (seqs * norm)
    raise ValueError(f"loss_agg {mode!r}: expected token-mean or seq-mean ({', '.join(AGGREGATIONS)})")
