"""Sequence packing on the real DeepSpeed engine (one CPU rank): the packed forward computes no
padding, gives the padded path's log-probs, and an update trains to the same loss, gradients and
weights (to 1e-5) on ZeRO-2 and ZeRO-3, with and without a token budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.model.rounding import rounded
from tests.support.updates import assert_same_update, one_update, probed_piece


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rounding", [0.0, 0.5])
def test_packed_and_padded_batches_give_the_same_logprobs_and_no_padding_is_computed(tiny_model: Path, rounding: float) -> None:
    """Rounding off: not one padding token goes through the model. On: each packed row's length is
    rounded up (a few shapes, not one per step), by at most `pack_rounding` of it, the same numbers."""
    engine, actor, piece, seen, _ = probed_piece(tiny_model, pack_sequences=True, max_tokens_per_microbatch=24, pack_rounding=rounding)
    micros = engine.micro_batches(piece)
    packed = torch.cat([actor.compute_logp(m) for m in micros])
    real_tokens = int(piece["attention_mask"].sum())
    assert len(micros) > 1 and all(kw["input_ids"].shape[0] == 1 for kw in seen)
    computed = [kw["input_ids"].shape[1] for kw in seen]
    real = [int(m["attention_mask"].sum()) for m in micros]
    if rounding:  # length L rounded up to a multiple of the largest power of two <= L / 2
        assert computed == [rounded(n, rounding) for n in real] and sum(computed) > real_tokens
        assert all(c <= n * (1 + rounding) and c % (1 << ((n // 2).bit_length() - 1)) == 0 for c, n in zip(computed, real, strict=True))
    else:
        assert sum(computed) == real_tokens  # no padding went through the model
    assert all("attention_mask" not in kw for kw in seen)
    padded = actor.compute_logp(piece)
    mask = piece["attention_mask"] != 0
    assert packed.shape == padded.shape
    assert torch.allclose(packed[mask], padded[mask], atol=1e-5)
    assert (packed[~mask] == 0).all()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("stage", "budget", "rounding"), [(2, 0, 0.0), (2, 20, 0.0), (3, 20, 0.0), (2, 20, 0.5)])
def test_a_packed_update_gives_the_padded_loss_gradients_and_weights(tiny_model: Path, stage: int, budget: int, rounding: float) -> None:
    padded = one_update(tiny_model, zero_stage=stage)
    packed = one_update(tiny_model, zero_stage=stage, pack_sequences=True, max_tokens_per_microbatch=budget, pack_rounding=rounding,
                    logp_chunk_tokens=7, ppo={"loss_agg": "seq-mean-token-mean"} if budget else {})
    if budget:  # sequence-level aggregation too: the loss sees the padded layout
        padded = one_update(tiny_model, zero_stage=stage, ppo={"loss_agg": "seq-mean-token-mean"})
    assert_same_update(padded, packed)
