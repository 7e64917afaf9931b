"""On the real DeepSpeed engine (one CPU rank): the default stage is no ZeRO, its checkpoint resumes on
it (weights and optimizer state back), and resuming it on ZeRO-2 is refused before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.intake.batch import collate, shard
from services.trainer.model.actor import PPOActor
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from tests.support.updates import uneven_groups


@pytest.mark.timeout(300)
def test_a_checkpoint_of_the_default_stage_resumes_on_it_and_is_refused_on_another(tiny_model: Path, tmp_path: Path) -> None:
    first = TrainEngine(TrainerSettings(model_path=str(tiny_model), output_dir=str(tmp_path), seed=0, lr=1e-2))
    assert first.stage == 0
    actor = PPOActor(first, first.settings.ppo)
    actor.ppo_update(shard(actor.compute_advantages(collate(uneven_groups(tiny_model))), 1, 1)[0])
    root = tmp_path / "checkpoints"
    first.save(root, "v00000001", {"version": 1})
    trained = first.full_state_dict() or {}

    resumed = TrainEngine(TrainerSettings(model_path=str(tiny_model), output_dir=str(tmp_path), seed=0, resume="auto"))
    assert resumed.stage == 0
    assert resumed.load(root, "v00000001")["version"] == 1
    for name, value in (resumed.full_state_dict() or {}).items():
        assert torch.equal(value, trained[name]), name
    assert resumed.engine.optimizer.state_dict()["state"]  # Adam's moments came back too

    with pytest.raises(ValueError, match=r"zero_stage=2.*written with ZeRO stage 0"):
        TrainEngine(TrainerSettings(model_path=str(tiny_model), output_dir=str(tmp_path), zero_stage=2, resume="auto"))
