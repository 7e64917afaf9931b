"""What a decoded group must satisfy before the trainer lets it near the model: every token id inside
the model's vocabulary (an id past the embedding is an IndexError that would end the trainer on every
resume), rows no longer than `max_seq_len` (attention memory grows with the square of the length),
finite rewards and log-probs (one NaN makes the whole step's loss and gradient NaN), and both within
bounds no real run crosses (a finite 3e38 reward makes the step's reward mean 1e36, which trips
`stop_at_reward`, and its advantages swamp every other group's; a -3e38 log-prob makes the importance
ratio 0 or infinite):
- rewards: |reward| <= `max_abs_reward` (default 1e6; verifiable rewards are 0/1, reward models and
  shaped rewards stay within hundreds);
- log-probs: within [`min_logprob`, `MAX_LOGPROB`]: a log-probability is <= 0 (1e-3 allows the float
  rounding of a log-softmax), and one below -1e4 (the default `min_logprob`) is a probability of
  e^-10000, far below the smallest float32 (~1e-45, a log of ~-103) that a sampler can draw from.

A failed check is a `Problem`: the cause it is counted under and a text naming what is wrong. The
decoder already refuses lengths that disagree with each other or with the metadata (`length_mismatch`)
and, given the limit, rows too long for it (`too_long`) before allocating anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CAUSES = ("malformed", "length_mismatch", "too_long", "empty", "oov_token", "non_finite", "out_of_bounds",
          "impossible_versions", "unissued_prompt")
"""Every cause a trajectory group is terminated for (`unissued_prompt`: the intake's, an answer to a
prompt this run never issued)."""


@dataclass(frozen=True)
class Problem:
    cause: str
    error: str


MAX_LOGPROB = 1e-3
"""Highest behaviour log-prob accepted: 0, plus the rounding of a float log-softmax."""


@dataclass(frozen=True)
class Limits:
    vocab_size: int | None
    """Token ids must be in [0, vocab_size) (the embedding's rows); None: not checked."""
    max_seq_len: int | None
    """Longest row accepted (tokens); None: no limit."""
    max_abs_reward: float = 1e6
    """Largest |reward| accepted."""
    min_logprob: float = -1e4
    """Lowest behaviour log-prob accepted (on the trained tokens)."""


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
    return _out_of_bounds(tensors, limits)


def _out_of_bounds(tensors: dict[str, np.ndarray], limits: Limits) -> Problem | None:
    rewards = np.abs(tensors["rewards"].astype(np.float64))
    if rewards.size and float(rewards.max()) > limits.max_abs_reward:
        return Problem("out_of_bounds", f"rewards: {int((rewards > limits.max_abs_reward).sum())} value(s) beyond "
                                        f"+-{limits.max_abs_reward:g} (max_abs_reward), e.g. {float(rewards.max()):.3g} in magnitude")
    trained = tensors["loss_mask"] != 0  # the prompt's positions carry no behaviour log-prob
    logprobs = tensors["logprobs"].astype(np.float64)[trained]
    bad = (logprobs < limits.min_logprob) | (logprobs > MAX_LOGPROB)
    if bad.any():
        return Problem("out_of_bounds", f"logprobs: {int(bad.sum())} value(s) outside [{limits.min_logprob:g}, {MAX_LOGPROB:g}] "
                                        f"(min_logprob), e.g. {float(logprobs[bad][0]):.3g}")
    return None
