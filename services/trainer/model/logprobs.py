"""Lean log-probs and entropy: the chosen token's log-prob and the entropy of each next-token
distribution, chunked over tokens, without the whole (tokens x vocabulary) float32 log-softmax.

`logp_from_logits` / `entropy_from_logits` (services.trainer.model.ppo) each build that tensor in full, and
autograd keeps it (and `exp` of it) for the backward pass: for a Qwen-size vocabulary (152k) and 32k
tokens that is 20 GB per copy. Here one autograd function computes both outputs a chunk of tokens at
a time, keeps only the per-token log-sum-exp and entropy for backward, and recomputes each chunk's
softmax there. Gradient with respect to the scaled logits z = logits / temperature, p = softmax(z):
    d logp_y / dz = onehot(y) - p
    d H / dz      = -p * (log p + H)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _chunk_stats(z: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp of `ids`, entropy, log-sum-exp) of float32 scaled logits z (n, V)."""
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse
    p = torch.exp(z - lse.unsqueeze(-1))
    ent = lse - (p * z).sum(-1)
    return logp, ent, lse


class _LogpEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, ids: torch.Tensor, temperature: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for s in range(0, n, chunk):
            z = logits[s : s + chunk].float() / temperature
            logp[s : s + chunk], ent[s : s + chunk], lse[s : s + chunk] = _chunk_stats(z, ids[s : s + chunk])
        ctx.save_for_backward(logits, ids, lse, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor, g_ent: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, ids, lse, ent = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            rows = slice(s, s + ctx.chunk)
            z = logits[rows].float() / ctx.temperature
            log_p = z - lse[rows].unsqueeze(-1)
            p = torch.exp(log_p)
            # -g_logp * p - g_ent * p * (log p + H), plus g_logp on the chosen token
            g = -p * (g_logp[rows].unsqueeze(-1) + g_ent[rows].unsqueeze(-1) * (log_p + ent[rows].unsqueeze(-1)))
            g.scatter_add_(-1, ids[rows].unsqueeze(-1), g_logp[rows].unsqueeze(-1))
            grad[rows] = (g / ctx.temperature).to(logits.dtype)
        return grad, None, None, None


def logp_entropy_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0, *,
                             entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logp_from_logits` and `entropy_from_logits` (services.trainer.model.ppo), the same values, from one
    whole-vocabulary float32 log-softmax instead of one each (and one scaled copy of the logits):
    one (tokens x vocabulary) tensor fewer kept for the backward pass. Entropy None unless asked."""
    logp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = F.pad(logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1), (1, 0), value=0.0)
    if not entropy:
        return picked, None
    return picked, F.pad(-(logp.exp() * logp).sum(-1), (1, 0), value=0.0)


def lean_logp_entropy(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                      chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy), each (B, T) float32 aligned with `input_ids` like `logp_from_logits` /
    `entropy_from_logits` (0 at t = 0); at most `chunk_tokens` rows of float32 vocabulary at a time."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    b, t, v = logits.shape
    # The whole (B*T, V) view, not logits[:, :-1] (a copy): the last position's outputs are dropped,
    # so its gradient is zero.
    ids = F.pad(input_ids[:, 1:].to(logits.device).long(), (0, 1)).reshape(-1)
    logp, ent = _LogpEntropy.apply(logits.reshape(-1, v), ids, float(temperature), int(chunk_tokens))
    return (F.pad(logp.view(b, t)[:, :-1], (1, 0), value=0.0), F.pad(ent.view(b, t)[:, :-1], (1, 0), value=0.0))


def rows_logp_entropy(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                      chunk_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy), each (K,) float32, of `ids` (K,) under the next-token logits (K, V) given row by
    row (no shift): chunked with `chunk_tokens` > 0, else the whole-vocabulary log-softmax."""
    if chunk_tokens > 0:
        logp, ent = _LogpEntropy.apply(logits, ids.to(logits.device).long(), float(temperature), int(chunk_tokens))
        return logp, ent
    lp = F.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(-1, ids.to(logits.device).long().unsqueeze(-1)).squeeze(-1), -(lp.exp() * lp).sum(-1)
