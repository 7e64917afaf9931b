"""The output projection folded into the chunked log-prob function: from hidden states and the
projection's weight (and bias) to the chosen token's log-prob and the entropy equals the full
computation through the whole logits, values and gradients (to the hidden states, the weight and
the bias), at any chunk size and temperature, with the probabilities kept for the backward pass or
recomputed there; a frozen weight gets no gradient; micro-batches accumulate into the weight's one
gradient buffer (tied to an input embedding too) to the sum of their gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.trainer.model.fused_head import head_logp_entropy
from services.trainer.model.ppo import entropy_from_logits, logp_from_logits


def _both(chunk: int, temperature: float, bias: bool, keep_mb: float = 0,
          entropy: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(values and gradients through the whole logits, the same through the fused function)."""
    torch.manual_seed(0)
    h0 = torch.randn(3, 11, 16, dtype=torch.float64).float()
    w0, b0 = torch.randn(50, 16).float() / 2, torch.randn(50).float()
    ids = torch.randint(0, 50, (3, 11))
    g_lp, g_ent = torch.randn(3, 11), torch.randn(3, 11) * entropy
    out = []
    for fused in (False, True):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        b = b0.clone().requires_grad_(True) if bias else None
        if fused:
            lp, ent = head_logp_entropy(h, w, b, ids, temperature, chunk_tokens=chunk, keep_mb=keep_mb)
        else:
            logits = F.linear(h, w, b)
            lp, ent = logp_from_logits(logits, ids, temperature), entropy_from_logits(logits, temperature)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        assert h.grad is not None and w.grad is not None
        out.append([lp, ent, h.grad, w.grad] + ([b.grad] if b is not None and b.grad is not None else []))
    return out[0], out[1]


@pytest.mark.parametrize("keep_mb", [0, 1], ids=["recomputed", "kept"])  # the 33 x 50 probabilities: 6.6 KB
@pytest.mark.parametrize(("chunk", "temperature", "bias", "entropy"),
                         [(1, 1.0, False, True), (7, 0.7, True, True), (1000, 1.3, False, True), (4, 1.0, True, True),
                          (5, 0.9, True, False)])
def test_fused_logp_entropy_and_gradients_equal_the_full_logits_computation(chunk: int, temperature: float, bias: bool,
                                                                            entropy: bool, keep_mb: float) -> None:
    full, fused = _both(chunk, temperature, bias, keep_mb, entropy)
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


@pytest.mark.parametrize("keep_mb", [0, 1], ids=["recomputed", "kept"])
def test_micro_batches_accumulate_into_the_tied_weights_one_gradient_buffer(keep_mb: float) -> None:
    """Two passes (micro-batches) through a weight shared with an input embedding whose lookup's
    gradient is sparse, as the trainer ties them: the weight's gradient is the sum of the two passes'
    full-logits gradients, and the second pass added to the first one's buffer (no second copy)."""
    torch.manual_seed(3)
    w0 = torch.randn(40, 8) / 2
    batches = [torch.randint(0, 40, (2, 6)) for _ in range(2)]

    def run(fused: bool) -> tuple[torch.Tensor, list[int]]:
        emb = torch.nn.Embedding(40, 8, sparse=True)
        emb.weight.data.copy_(w0)
        buffers = []
        for ids in batches:
            h = torch.tanh(emb(ids))
            if fused:
                lp, ent = head_logp_entropy(h, emb.weight, None, ids, chunk_tokens=5, keep_mb=keep_mb, into_grad=True)
            else:
                logits = F.linear(h, emb.weight)
                lp, ent = logp_from_logits(logits, ids), entropy_from_logits(logits)
            (lp[:, 1:].sum() + 0.1 * ent[:, 1:].sum()).backward()
            assert emb.weight.grad is not None
            buffers.append(emb.weight.grad.data_ptr())
        return emb.weight.grad, buffers

    full, _ = run(False)
    fused, buffers = run(True)
    assert torch.allclose(full, fused, atol=1e-5), (full - fused).abs().max()
    assert buffers[0] == buffers[1]  # the second pass's gradient went into the first's buffer
