"""The columns of a collated batch: the ones the trainer gives meaning to, and a workflow's extra ones
(per-sample or per-token columns it returned, which reach the algorithm's loss)."""

from __future__ import annotations

from typing import Any

TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")
RESERVED_KEYS = frozenset((*TOKEN_KEYS, "rewards", "group_index", "advantages", "sample_advantages",
                           "proximal_logp", "ref_logp", "total_tokens", "total_seqs", "_packed"))
"""Names the trainer gives meaning to: a workflow's extra column may not use them."""


def extra_columns(batch: dict[str, Any]) -> list[str]:
    """Names of the workflow's extra columns in a collated batch or a piece."""
    return sorted(k for k in batch if k not in RESERVED_KEYS)
