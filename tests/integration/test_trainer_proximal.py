"""The proximal log-probs of the decoupled objective, on the real DeepSpeed engine (one CPU rank): the
first mini-batch reuses its training forward's log-probs (its policy is the proximal one) instead of
a separate no-grad forward, and the update is the one the recomputing path gives (loss, every stat,
gradients and weights to 1e-6) with 1 and 2 mini-batches, padded and packed, with micro-batches,
token and sequence (GSPO) ratios;
the extra forward is skipped then, and still run when the model's forward has dropout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.intake.batch import collate, shard
from services.trainer.model.actor import PPOActor, to_tensors
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from tests.support.updates import uneven_groups

Update = tuple[dict[str, float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor], int, list[int]]


def _update(model: Path, *, n_minibatches: int, recompute: bool, **settings: Any) -> Update:
    """(stats, gradients before each optimizer step, weights after, model forward calls, micro-batches
    per mini-batch) of one update."""
    from deepspeed.utils import safe_get_full_grad

    ppo = {"n_minibatches": n_minibatches, "recompute_proximal": recompute, **settings.pop("ppo", {})}
    s = TrainerSettings(model_path=str(model), seed=0, ppo=ppo, **settings)
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    grads: list[dict[str, torch.Tensor]] = []
    step = engine.engine.step

    def probed_step() -> None:  # the accumulated gradients the optimizer is about to use
        grads.append({n: safe_get_full_grad(p).detach().clone() for n, p in engine.engine.module.named_parameters()})
        step()

    engine.engine.step = probed_step
    calls = [0]
    engine.engine.module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    pieces = shard(actor.compute_advantages(collate(uneven_groups(model))), 1, n_minibatches)[0]
    micros = [len(engine.micro_batches(to_tensors(p))) for p in pieces]  # no model call
    stats = actor.ppo_update(pieces)
    return stats, grads, engine.full_state_dict() or {}, calls[0], micros


LAYOUTS = {
    "padded": {},
    "micro-batches": {"max_tokens_per_microbatch": 20},
    "packed": {"pack_sequences": True},
    "packed micro-batches": {"pack_sequences": True, "max_tokens_per_microbatch": 20},
    # GSPO's sequence ratio: a proximal log-prob that kept its gradient would change the gradient
    "gspo micro-batches": {"max_tokens_per_microbatch": 20,
                           "ppo": {"policy_loss": "gspo", "eps_clip": 3e-4, "loss_agg": "seq-mean-token-mean"}},
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n_minibatches", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reusing_the_training_forward_gives_the_recomputed_update(tiny_model: Path, n_minibatches: int, layout: str) -> None:
    reused = _update(tiny_model, n_minibatches=n_minibatches, recompute=False, **LAYOUTS[layout])
    recomputed = _update(tiny_model, n_minibatches=n_minibatches, recompute=True, **LAYOUTS[layout])
    assert reused[0].keys() == recomputed[0].keys()
    for key, value in recomputed[0].items():
        assert reused[0][key] == pytest.approx(value, abs=1e-6, rel=1e-6), key
    assert len(reused[1]) == len(recomputed[1]) == n_minibatches
    for a, b in zip(reused[1], recomputed[1], strict=True):
        for name in b:
            assert torch.allclose(a[name], b[name], atol=1e-6, rtol=0), name
    for name, w in recomputed[2].items():
        assert torch.allclose(reused[2][name], w, atol=1e-6, rtol=0), name
    # the update did something, and the decoupled weight mattered (behaviour != proximal)
    assert any((w - reused[2][n]).abs().max() > 0 for n, w in _initial(tiny_model).items())
    assert recomputed[0]["imp_weight_mean"] != pytest.approx(1.0, abs=1e-3)
    # one training forward per micro-batch, plus a no-grad one for each micro-batch of the later
    # mini-batches (their proximal policy is the one before the first step); recomputing adds the first's
    micros = reused[4]
    assert reused[3] == sum(micros) + sum(micros[1:])
    assert recomputed[3] == 2 * sum(micros)
    if "micro" in layout:
        assert micros[0] > 1


def _initial(model: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(model).named_parameters()}


@pytest.mark.timeout(300)
def test_a_model_with_dropout_keeps_the_proximal_forward(tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "dropout"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    stats, _, _, calls, micros = _update(model, n_minibatches=1, recompute=False, max_tokens_per_microbatch=20)
    assert micros[0] > 1
    assert calls == 2 * micros[0]  # a training forward with dropout is not the proximal policy's
    assert stats["train_tokens"] > 0
