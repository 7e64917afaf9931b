"""The pieces of a cheaper training step that must not change what it computes: log-probs and entropy
from one log-softmax, and micro-batch stats merged as device scalars."""

from __future__ import annotations

import torch

from services.trainer.model.logprobs import logp_entropy_from_logits
from services.trainer.model.micro import merge_stats
from services.trainer.model.ppo import entropy_from_logits, logp_from_logits


def test_one_log_softmax_gives_the_values_and_gradients_of_two() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=gen, dtype=torch.float32)
    ids = torch.randint(0, 11, (3, 7), generator=gen)
    weights = torch.randn(2, 3, 7, generator=gen)

    def run(shared: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = logits.clone().requires_grad_(True)
        if shared:
            logp, ent = logp_entropy_from_logits(x, ids, 0.7)
            assert ent is not None
        else:
            logp, ent = logp_from_logits(x, ids, 0.7), entropy_from_logits(x, 0.7)
        ((logp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
        assert x.grad is not None
        return logp.detach(), ent.detach(), x.grad

    one, two = run(True), run(False)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert torch.allclose(one[2], two[2], atol=1e-6, rtol=0)
    assert one[2].abs().max() > 0
    assert logp_entropy_from_logits(logits, ids, 0.7, entropy=False)[1] is None


def test_tensor_stats_merge_like_float_ones() -> None:
    floats = [{"loss": 1.25, "imp_weight_max": 2.0, "tokens": 3.0}, {"loss": -0.5, "imp_weight_max": 4.5, "tokens": 2.0},
              {"loss": 0.125, "imp_weight_max": 1.0, "tokens": 0.0}]
    tensors = [{k: torch.tensor(v, dtype=torch.float64) for k, v in s.items()} for s in floats]
    merged = merge_stats(tensors)
    assert all(isinstance(v, torch.Tensor) for v in merged.values())
    assert {k: float(v) for k, v in merged.items()} == merge_stats(floats) == {"loss": 0.875, "imp_weight_max": 4.5, "tokens": 5.0}
