"""SGLang's `frequency_penalty`, `presence_penalty` and `logit_bias` on the CPU server.

As SGLang's penalizers: a row's logits get `logit_bias[token]` added and, for every token already in
its output, `frequency_penalty * count + presence_penalty` subtracted (output tokens only, not the
prompt), before the grammar mask, temperature, top-k and top-p; the logprob reported is that of the
distribution the token was then drawn from. Rows without any of them cost nothing.
"""

from __future__ import annotations

from typing import Any

import torch


def wants(params: Any) -> bool:
    return bool(params.frequency_penalty or params.presence_penalty or params.logit_bias)


def adjust(logits: torch.Tensor, rows: list[Any]) -> torch.Tensor:
    """`logits` [B, V] with each penalised row's bias and penalties applied (a new tensor when any)."""
    if not any(r.counts is not None for r in rows):
        return logits
    logits = logits.float().clone()
    for i, row in enumerate(rows):
        p = row.params
        if row.counts is None:
            continue
        for token, bias in p.logit_bias:
            logits[i, token] += bias
        if p.frequency_penalty or p.presence_penalty:
            logits[i] -= p.frequency_penalty * row.counts + p.presence_penalty * (row.counts > 0).float()
    return logits


def observe(rows: list[Any], tokens: list[int]) -> None:
    """Count each penalised row's new token."""
    for row, token in zip(rows, tokens, strict=True):
        if row.counts is not None:
            row.counts[token] += 1
