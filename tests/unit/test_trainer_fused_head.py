"""The output projection folded into the chunked log-prob function: from hidden states and the
projection's weight (and bias) to the chosen token's log-prob and the entropy equals the full
computation through the whole logits, values and gradients (to the hidden states, the weight and
the bias), at any chunk size and temperature; a frozen weight gets no gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.trainer.fused_head import head_logp_entropy
from services.trainer.ppo import entropy_from_logits, logp_from_logits


def _both(chunk: int, temperature: float, bias: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(values and gradients through the whole logits, the same through the fused function)."""
    torch.manual_seed(0)
    h0 = torch.randn(3, 11, 16, dtype=torch.float64).float()
    w0, b0 = torch.randn(50, 16).float() / 2, torch.randn(50).float()
    ids = torch.randint(0, 50, (3, 11))
    g_lp, g_ent = torch.randn(3, 11), torch.randn(3, 11)
    out = []
    for fused in (False, True):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        b = b0.clone().requires_grad_(True) if bias else None
        if fused:
            lp, ent = head_logp_entropy(h, w, b, ids, temperature, chunk_tokens=chunk)
        else:
            logits = F.linear(h, w, b)
            lp, ent = logp_from_logits(logits, ids, temperature), entropy_from_logits(logits, temperature)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        assert h.grad is not None and w.grad is not None
        out.append([lp, ent, h.grad, w.grad] + ([b.grad] if b is not None and b.grad is not None else []))
    return out[0], out[1]


@pytest.mark.parametrize(("chunk", "temperature", "bias"), [(1, 1.0, False), (7, 0.7, True), (1000, 1.3, False), (4, 1.0, True)])
def test_fused_logp_entropy_and_gradients_equal_the_full_logits_computation(chunk: int, temperature: float, bias: bool) -> None:
    full, fused = _both(chunk, temperature, bias)
    assert len(full) == len(fused) == (5 if bias else 4)
    for name, a, b in zip(("logp", "entropy", "grad_h", "grad_w", "grad_b"), full, fused, strict=False):
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (name, (a - b).abs().max())
    assert fused[0][:, 0].abs().max() == 0 and fused[1][:, 0].abs().max() == 0
    assert fused[2][:, -1].abs().max() == 0  # the last position predicts nothing the loss sees


def test_a_frozen_weight_gets_no_gradient_and_the_hidden_states_still_do() -> None:
    torch.manual_seed(2)
    h = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(30, 8)
    lp, ent = head_logp_entropy(h, w, None, torch.randint(0, 30, (2, 5)), chunk_tokens=3)
    (lp.sum() + ent.sum()).backward()
    assert w.grad is None and h.grad is not None and h.grad[:, :-1].abs().max() > 0


def test_a_chunk_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        head_logp_entropy(torch.zeros(1, 2, 3), torch.zeros(4, 3), None, torch.zeros(1, 2, dtype=torch.long), chunk_tokens=0)
