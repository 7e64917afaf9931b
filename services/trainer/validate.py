"""What a decoded group must satisfy before the trainer lets it near the model: every token id inside
the model's vocabulary (an id past the embedding is an IndexError that would end the trainer on every
resume), rows no longer than `max_seq_len` (attention memory grows with the square of the length),
and finite rewards and log-probs (one NaN makes the whole step's loss and gradient NaN).

A failed check is a `Problem`: the cause it is counted under and a text naming what is wrong. The
decoder already refuses lengths that disagree with each other or with the metadata (`length_mismatch`)
and, given the limit, rows too long for it (`too_long`) before allocating anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CAUSES = ("malformed", "length_mismatch", "too_long", "empty", "oov_token", "non_finite", "impossible_versions",
          "unissued_prompt")
"""Every cause a trajectory group is terminated for (`unissued_prompt`: the intake's, an answer to a
prompt this run never issued)."""


@dataclass(frozen=True)
class Problem:
    cause: str
    error: str


@dataclass(frozen=True)
class Limits:
    vocab_size: int | None
    """Token ids must be in [0, vocab_size) (the embedding's rows); None: not checked."""
    max_seq_len: int | None
    """Longest row accepted (tokens); None: no limit."""


def model_limits(model_path: str | Path, max_seq_len: int | None) -> Limits:
    """The vocabulary from the model's config, and `max_seq_len` or else the config's
    `max_position_embeddings` (None when the config has neither)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_path))
    text = getattr(config, "text_config", None) or config  # multimodal configs nest the LM's
    vocab = getattr(text, "vocab_size", None)
    limit = max_seq_len if max_seq_len is not None else getattr(text, "max_position_embeddings", None)
    return Limits(int(vocab) if vocab else None, int(limit) if limit else None)


def check_group(tensors: dict[str, np.ndarray], limits: Limits) -> Problem | None:
    """The first thing wrong with a decoded group, or None if it can be trained on."""
    ids = tensors["input_ids"]
    lengths = (tensors["attention_mask"] != 0).sum(axis=1)
    if ids.shape[0] == 0 or not lengths.any():
        return Problem("empty", f"no tokens in the group ({ids.shape[0]} samples)")
    if limits.max_seq_len is not None and int(lengths.max()) > limits.max_seq_len:
        return Problem("too_long", f"input_ids: a row of {int(lengths.max())} tokens is longer than max_seq_len {limits.max_seq_len}")
    if ids.dtype.kind == "f" and not np.isfinite(ids).all():
        return Problem("non_finite", "input_ids: NaN or infinite token ids")
    if limits.vocab_size is not None:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= limits.vocab_size:
            bad = low if low < 0 else high
            return Problem("oov_token", f"input_ids: token id {bad} is outside the model's vocabulary [0, {limits.vocab_size})")
    for key in ("rewards", "logprobs"):
        values = tensors[key]
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            n = int((~np.isfinite(values)).sum())
            return Problem("non_finite", f"{key}: {n} value(s) are NaN or infinite")
    return None
