"""Lean log-probs and entropy (chunked, no whole-vocabulary log-softmax) equal the full computation,
values and gradients, at any chunk size and temperature."""

from __future__ import annotations

import pytest
import torch

from services.trainer.model.logprobs import lean_logp_entropy
from services.trainer.model.ppo import entropy_from_logits, logp_from_logits


@pytest.mark.parametrize(("chunk", "temperature"), [(1, 1.0), (7, 0.7), (1000, 1.3)])
def test_chunked_logp_and_entropy_equal_the_full_computation_with_gradients(chunk: int, temperature: float) -> None:
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 11, 50, dtype=torch.float64)).float()
    ids = torch.randint(0, 50, (3, 11))
    g_lp, g_ent = torch.randn(3, 11), torch.randn(3, 11)

    full = logits.clone().requires_grad_(True)
    lp, ent = logp_from_logits(full, ids, temperature), entropy_from_logits(full, temperature)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()

    lean = logits.clone().requires_grad_(True)
    lp2, ent2 = lean_logp_entropy(lean, ids, temperature, chunk_tokens=chunk)
    ((lp2 * g_lp).sum() + (ent2 * g_ent).sum()).backward()

    assert lp2.shape == lp.shape and ent2.shape == ent.shape
    assert torch.allclose(lp2, lp, atol=1e-5) and torch.allclose(ent2, ent, atol=1e-5)
    assert lp2[:, 0].abs().max() == 0 and ent2[:, 0].abs().max() == 0
    assert lean.grad is not None and full.grad is not None
    assert torch.allclose(lean.grad, full.grad, atol=1e-5)
    assert lean.grad[:, -1].abs().max() == 0  # the last position predicts nothing the loss sees


def test_bfloat16_logits_give_float32_outputs_and_bfloat16_gradients() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 30).bfloat16().requires_grad_(True)
    ids = torch.randint(0, 30, (2, 5))
    lp, ent = lean_logp_entropy(logits, ids, chunk_tokens=3)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert torch.allclose(lp, logp_from_logits(logits.detach(), ids), atol=1e-5)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


def test_a_chunk_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        lean_logp_entropy(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), chunk_tokens=0)
