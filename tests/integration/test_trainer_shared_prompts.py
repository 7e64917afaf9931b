"""Shared prompts on the real DeepSpeed engine (one CPU rank): a group's samples share one copy of their
prompt in the packed row; the log-probs are the padded path's, fewer tokens go through the model, and
an update trains to the same loss, gradients and weights (to 1e-5), fused output projection or not,
with and without a token budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.model.packing import KEY
from services.trainer.model.rounding import rounded
from services.trainer.settings import TrainerSettings
from tests.support.updates import assert_same_update, one_update, probed_piece


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rounding", [0.0, 0.5])
def test_shared_prompts_give_the_padded_logprobs_through_fewer_tokens(tiny_model: Path, rounding: float) -> None:
    """Also with each row's length and its answer tokens' count rounded up (`pack_rounding`): the
    padding is a segment of its own that no real token attends to, and its outputs are never read."""
    engine, actor, piece, seen, forward = probed_piece(tiny_model, pack_sequences=True, share_prompts=True, max_tokens_per_microbatch=40,
                                                       pack_rounding=rounding)
    micros = engine.micro_batches(piece)
    shared = torch.cat([actor.compute_logp(m) for m in micros])
    engine.engine.forward = forward
    padded = actor.compute_logp(piece)
    real_tokens = int(piece["attention_mask"].sum())
    computed = sum(kw["input_ids"].numel() for kw in seen)
    prompt = int(piece["loss_mask"][0].int().argmax())  # every row of these groups: <bos>ddd=
    rows = int(piece["input_ids"].shape[0])
    assert len(micros) > 1 and all(kw["attention_mask"].dim() == 4 for kw in seen)
    # each micro-batch computes each of its distinct prompts once, not once per row (plus the rounding)
    assert computed < real_tokens and computed <= (1 + rounding) * (real_tokens - (rows - 2 * len(micros)) * prompt)
    if rounding:
        trees = [m[KEY].tree for m in micros]
        assert all(kw["input_ids"].shape[1] == rounded(kw["input_ids"].shape[1], rounding) for kw in seen)
        assert any(t.src.numel() > t.dest.numel() for t in trees)  # answer rows rounded up too, extra ones dropped
    trained = piece["loss_mask"] != 0
    assert shared.shape == padded.shape
    assert torch.allclose(shared[trained], padded[trained], atol=1e-5)
    assert (shared[~trained] == 0).all()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("budget", "chunk", "rounding"), [(0, 7, 0.0), (40, 7, 0.0), (40, 0, 0.0), (40, 7, 0.5)])
def test_a_shared_prompt_update_gives_the_padded_loss_gradients_and_weights(tiny_model: Path, budget: int, chunk: int,
                                                                             rounding: float) -> None:
    padded = one_update(tiny_model, zero_stage=2)
    shared = one_update(tiny_model, zero_stage=2, pack_sequences=True, share_prompts=True, max_tokens_per_microbatch=budget,
                        logp_chunk_tokens=chunk, pack_rounding=rounding)
    assert_same_update(padded, shared)


def test_shared_prompts_need_packing_and_a_kernel_that_takes_a_mask(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="share_prompts needs pack_sequences"):
        TrainerSettings(model_path=str(tiny_model), share_prompts=True)
    with pytest.raises(ValueError, match="flash_attention_2 takes no 4-D attention mask"):
        TrainerSettings(model_path=str(tiny_model), pack_sequences=True, share_prompts=True, attn_implementation="flash_attention_2")
