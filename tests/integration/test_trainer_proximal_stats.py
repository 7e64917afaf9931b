"""The stats of an update (one CPU rank, real DeepSpeed engine), read back from the device once per
update, are the ones computed by hand from a plain forward of the same weights: the loss and its
parts, the token count, the importance-weight mean / max / capped fraction and the clip fraction,
in one pass and in micro-batches, decoupled and not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.intake.batch import collate, shard
from services.trainer.model.actor import PPOActor, to_tensors
from services.trainer.model.engine import TrainEngine
from services.trainer.model.ppo import entropy_from_logits, logp_from_logits, ppo_token_loss
from services.trainer.settings import TrainerSettings
from tests.support.updates import uneven_groups


def _by_hand(model: Path, piece: dict[str, torch.Tensor], *, decoupled: bool) -> dict[str, float]:
    """The first update's stats: the policy before the step is the initial model (and the proximal one)."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = net(input_ids=piece["input_ids"].long(), attention_mask=piece["attention_mask"].long()).logits
    ids = piece["input_ids"].long()
    logp, ent = logp_from_logits(logits, ids), entropy_from_logits(logits)
    mask = piece["loss_mask"] != 0
    parts = ppo_token_loss(logp, piece["logprobs"].float(), piece["advantages"].float(), mask, eps_clip=0.2,
                           proximal_logp=logp if decoupled else None, imp_weight_cap=2.0)
    tokens = float(mask.sum())
    pg, entropy = float(parts.pg[mask].sum()) / tokens, float(ent[mask].sum()) / tokens
    return {
        "loss": pg - 0.03 * entropy, "pg_loss": pg, "entropy": entropy, "kl": 0.0, "train_tokens": tokens,
        "clip_fraction": float(parts.clipped.sum()) / tokens, "imp_weight_capped_fraction": float(parts.capped.sum()) / tokens,
        "imp_weight_mean": float(parts.imp_weight[mask].sum()) / tokens, "imp_weight_max": float(parts.imp_weight[mask].max()),
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("budget", [0, 20])
def test_update_stats_are_the_hand_computed_ones(tiny_model: Path, decoupled: bool, budget: int) -> None:
    s = TrainerSettings(model_path=str(tiny_model), seed=0, max_tokens_per_microbatch=budget,
                        ppo={"decoupled": decoupled, "entropy_coef": 0.03, "eps_clip": 0.2, "behav_imp_weight_cap": 2.0})
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    pieces = shard(actor.compute_advantages(collate(uneven_groups(tiny_model))), 1, 1)[0]
    expected = _by_hand(tiny_model, to_tensors(pieces[0]), decoupled=decoupled)
    if budget:
        assert len(engine.micro_batches(to_tensors(pieces[0]))) > 1
    stats = actor.ppo_update(pieces)
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, abs=1e-5, rel=1e-5), key
    assert all(isinstance(v, float) for v in stats.values())
    # the inputs exercise what is counted: capped tokens (decoupled), clipped ones (ratio to behaviour)
    assert expected["imp_weight_capped_fraction" if decoupled else "clip_fraction"] > 0
    assert expected["imp_weight_mean"] != pytest.approx(1.0, abs=1e-3) or not decoupled
