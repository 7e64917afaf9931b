"""The KL term's reference model: none exists with the KL term off; `reference_placement` cpu keeps
it in host memory between updates and zero3 shards it with DeepSpeed ZeRO-3, each giving the same
update as a full copy on the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.intake.batch import collate, shard
from services.trainer.model.actor import PPOActor
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from tests.support.updates import uneven_groups


def _update(tiny_model: Path, placement: str) -> tuple[TrainEngine, dict[str, float]]:
    s = TrainerSettings(model_path=str(tiny_model), seed=0, reference_placement=placement, ppo={"kl_coef": 0.1})
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    batch = actor.compute_advantages(collate(uneven_groups(tiny_model)))
    for _ in range(2):  # the second update sees a policy that moved away from the reference
        stats = actor.ppo_update(shard(batch, 1, 1)[0])
    return engine, stats


def test_no_reference_model_when_the_kl_term_is_off(tiny_model: Path) -> None:
    engine = TrainEngine(TrainerSettings(model_path=str(tiny_model), reference_placement="zero3", ppo={"kl_coef": 0.0}))
    assert engine.ref_model is None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", ["cpu", "zero3"])
def test_each_placement_gives_the_update_of_a_copy_on_the_device(tiny_model: Path, placement: str) -> None:
    _, expected = _update(tiny_model, "device")
    engine, got = _update(tiny_model, placement)
    assert expected["kl"] > 0
    for key in ("loss", "kl", "pg_loss", "entropy"):
        assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    ref = engine.ref_model
    assert ref is not None
    params = list(ref.parameters())
    assert params and not any(p.requires_grad for p in params)
    if placement == "cpu":
        assert all(p.device.type == "cpu" for p in params)
    else:  # every parameter is ZeRO-3's: a shard per rank (the tiny model's are all small enough for
        # ZeRO-3 to keep them whole after their first gather, as it does with a real model's norms)
        assert all(hasattr(p, "ds_tensor") for p in params)
        assert sum(p.ds_numel for p in params) == sum(p.numel() for p in engine.engine.module.parameters())


def test_a_zero3_reference_starts_partitioned(tiny_model: Path) -> None:
    engine = TrainEngine(TrainerSettings(model_path=str(tiny_model), reference_placement="zero3", ppo={"kl_coef": 0.1}))
    assert engine.ref_model is not None
    assert all(p.numel() == 0 and p.ds_numel > 0 for p in engine.ref_model.parameters())


def test_a_sharded_reference_with_kl_in_reward_on_several_ranks_is_refused() -> None:
    from services.trainer.model.reference import Reference

    s = TrainerSettings(reference_placement="zero3", ppo={"kl_coef": 0.1, "kl_in": "reward"})
    with pytest.raises(ValueError, match="kl_in reward"):
        Reference(s, torch.device("cpu"), 2, deepspeed=None)
