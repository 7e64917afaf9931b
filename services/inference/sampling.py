"""Batched sampling with per-row parameters, returning the logprob of each chosen token under the
distribution it was actually drawn from (temperature, top-k and top-p applied, renormalised).

Each row draws its uniform number from its own generator, so a request with `sampling_seed` gets the
same tokens whatever else is in the batch; the draw is an inverse-CDF lookup, one batched op.
Greedy rows (temperature 0 or top_k 1) take the argmax and report its logprob under softmax(logits).
A row with a grammar (`json_schema` / `regex` / `ebnf`, services/inference/grammar.py) has every token its
grammar forbids masked to -inf first, so its logprobs are those of the constrained, renormalised
distribution the token was drawn from, and the token is then fed to its matcher.
A row whose params ask for `top_logprobs_num` N also gets the N most likely tokens of that same
distribution (so the sampled token is among them whenever it ranks in the top N); tokens the filters
removed (probability 0) are left out, so a row may get fewer than N.
"""

from __future__ import annotations

import torch

from services.inference.grammar import Matchers, advance, mask_logits
from services.inference.requests import SamplingParams


def _filter(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask logits outside each row's top-k / nucleus with -inf."""
    vocab = scaled.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in top_p):
        return scaled
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= torch.tensor(ks).unsqueeze(1)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token: keep while < top_p
    drop |= before >= torch.tensor(top_p, dtype=scaled.dtype).unsqueeze(1)
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


TopLogprobs = list[tuple[float, int]]
"""The most likely tokens of one position, most likely first: (logprob, token id)."""


def _top(logp: torch.Tensor, params: list[SamplingParams]) -> list[TopLogprobs | None]:
    """Per row: its `top_logprobs_num` most likely tokens (finite logprobs only), None when not asked."""
    ns = [min(p.top_logprobs_num, logp.shape[-1]) for p in params]
    if not any(ns):
        return [None] * len(params)
    values, ids = torch.topk(logp, max(ns), dim=-1)  # sorted, most likely first
    out: list[TopLogprobs | None] = []
    for row, n in enumerate(ns):
        pairs = zip(values[row, :n].tolist(), ids[row, :n].tolist(), strict=True)
        out.append([(v, t) for v, t in pairs if v != float("-inf")] if n else None)
    return out


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """logits [B, V] -> (token per row, its logprob)."""
    tokens, chosen, _ = sample_top(logits, params, generators)
    return tokens, chosen


def sample_top(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator], matchers: Matchers | None = None,
    dead: set[int] | None = None,
) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """logits [B, V] -> (token per row, its logprob, the row's top log-probs or None). `matchers`: per
    row its grammar matcher or None (constrained rows are masked, then advanced by their token); rows
    whose grammar allows no token are added to `dead` (grammar.py)."""
    logits, stuck = mask_logits(logits.float(), matchers)
    if dead is not None:
        dead |= stuck
    first = params[0]
    if all(p is first for p in params):  # one setting for the whole batch (the usual case: parsing caches them)
        greedy = [first.greedy] * len(params)
        temps: torch.Tensor | float = 1.0 if first.greedy else first.temperature
        ks, ps = [-1 if first.greedy else first.top_k] * len(params), [1.0 if first.greedy else first.top_p] * len(params)
    else:
        greedy = [p.greedy for p in params]
        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]).unsqueeze(1)
        ks = [-1 if g else p.top_k for p, g in zip(params, greedy, strict=True)]
        ps = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
    logp = torch.log_softmax(_filter(logits / temps, ks, ps), dim=-1)
    if all(greedy):
        tokens = logp.argmax(dim=-1)
    else:
        cdf = logp.exp().cumsum(dim=-1)
        target = (_uniforms(generators) * cdf[:, -1]).unsqueeze(1)
        drawn = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
        tokens = drawn if not any(greedy) else torch.where(torch.tensor(greedy), logp.argmax(dim=-1), drawn)
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    token_list = tokens.tolist()
    advance(matchers, token_list, stuck)
    return token_list, chosen.tolist(), _top(logp, params)


def _uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    """One uniform number per row, each from its row's generator. Rows sharing a generator (the
    server's, for requests without `sampling_seed`) draw theirs in one call, in row order; a seeded
    row's generator is its own, so its draws never depend on the rest of the batch."""
    first = generators[0]
    if all(g is first for g in generators):
        return torch.rand(len(generators), generator=first)
    rows_of: dict[int, list[int]] = {}
    for i, g in enumerate(generators):
        rows_of.setdefault(id(g), []).append(i)
    u = torch.empty(len(generators))
    for rows in rows_of.values():
        u[rows] = torch.rand(len(rows), generator=generators[rows[0]])
    return u
