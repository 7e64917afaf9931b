"""One rank training in float32 under ZeRO-2: the weights gathered for publishing are read straight
from the module (no collective per parameter); they must be the optimizer's fp32 master copy bit for
bit, after a real step."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.timeout(180)
def test_the_fast_gather_equals_the_fp32_master_copy_after_a_step(tiny_model: Path) -> None:
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    from services.trainer.intake.batch import shard
    from services.trainer.model.actor import PPOActor
    from services.trainer.model.collective import Command, execute
    from services.trainer.model.engine import TrainEngine
    from services.trainer.settings import TrainerSettings
    from tests.integration.test_trainer_zero import _batch

    s = TrainerSettings(model_path=str(tiny_model), zero_stage=2, seed=0, lr=1e-2)
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    before = engine.full_state_dict()
    batch = actor.compute_advantages(_batch(str(tiny_model)))
    res = execute(engine, actor, Command("train", pieces=shard(batch, 1, s.ppo.n_minibatches)[0], weights_state=True))
    assert res.state is not None and before is not None and res.stats["weights_gather_s"] >= 0
    assert any(not torch.equal(res.state[k], before[k]) for k in before)  # the step changed the weights
    for name, param in engine.engine.module.named_parameters():
        master = safe_get_full_fp32_param(param)
        assert master is not None and torch.equal(res.state[name], master), name
        assert res.state[name].data_ptr() != param.data_ptr()  # a copy: the next step must not change it
