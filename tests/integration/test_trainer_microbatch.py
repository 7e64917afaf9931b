"""The trainer for real models, on the real DeepSpeed engine (one CPU rank, ZeRO-0, 2 and 3): a
mini-batch cut into micro-batches by a token budget trains to the same loss, gradients and weights as
one pass; chunked log-probs and gradient checkpointing leave them unchanged too; the LR schedule is
followed optimizer step by optimizer step; no reference model exists while the KL term is off."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.trainer.intake.batch import collate, shard
from services.trainer.model.actor import PPOActor
from services.trainer.model.engine import TrainEngine
from services.trainer.model.schedule import lr_factor
from services.trainer.settings import TrainerSettings
from tests.support.updates import assert_same_update, one_update, uneven_groups


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_micro_batches_by_token_budget_give_the_one_pass_loss_gradients_and_weights(tiny_model: Path, stage: int) -> None:
    one = one_update(tiny_model, zero_stage=stage)
    # ~8 tokens per row: a budget of 20 cuts each 6-row mini-batch piece into 3 micro-batches of 2 rows
    micro = one_update(tiny_model, zero_stage=stage, max_tokens_per_microbatch=20)
    assert_same_update(one, micro)
    assert micro[3] > one[3]  # the budget really cut the mini-batches: more forward passes
    assert any(g.abs().max() > 0 for g in one[1][0].values())


@pytest.mark.timeout(300)
def test_without_zero_the_update_is_zero_2s(tiny_model: Path) -> None:
    """ZeRO stage 0 (the optimizer on the module's own parameters, gradients accumulated in them,
    clipped by the trainer) trains to ZeRO-2's loss, gradients, norm and weights."""
    assert_same_update(one_update(tiny_model, zero_stage=2), one_update(tiny_model, zero_stage=0, max_tokens_per_microbatch=20))


@pytest.mark.timeout(300)
def test_chunked_logp_and_gradient_checkpointing_leave_the_update_unchanged(tiny_model: Path) -> None:
    plain = one_update(tiny_model)
    assert_same_update(plain, one_update(tiny_model, logp_chunk_tokens=5, gradient_checkpointing=True, max_tokens_per_microbatch=30))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_the_lr_schedule_is_followed_step_by_step(tiny_model: Path, schedule: str) -> None:
    s = TrainerSettings(model_path=str(tiny_model), seed=0, lr=1e-3, lr_schedule=schedule, warmup_steps=2,
                        lr_decay_steps=6, lr_min_ratio=0.1, ppo={"n_minibatches": 1})
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    batch = actor.compute_advantages(collate(uneven_groups(tiny_model)))
    seen = []
    for _ in range(8):  # 8 optimizer steps (updates of one mini-batch), past the decay's end
        seen.append(engine.lr())
        actor.ppo_update(shard(batch, 1, 1)[0])
    expected = [1e-3 * lr_factor(i, schedule, 2, 6, 0.1) for i in range(8)]
    assert seen == pytest.approx(expected, rel=1e-9)
    assert seen[:3] == pytest.approx([5e-4, 1e-3, 1e-3])  # warmup, then the decay starts from lr
    assert seen[4] == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # halfway through the decay (steps 2..6)
    assert seen[-2:] == pytest.approx([1e-4, 1e-4])  # the floor, lr_min_ratio x lr
    assert all(math.isfinite(x) for x in seen)


@pytest.mark.timeout(300)
def test_no_reference_model_exists_when_the_kl_term_is_off(tiny_model: Path) -> None:
    off = TrainEngine(TrainerSettings(model_path=str(tiny_model), ppo={"kl_coef": 0.0}))
    assert off.ref_model is None
    with pytest.raises(RuntimeError, match="kl_coef"):
        off.forward({"input_ids": torch.ones(1, 3), "attention_mask": torch.ones(1, 3)}, reference=True)
    on = TrainEngine(TrainerSettings(model_path=str(tiny_model), ppo={"kl_coef": 0.1}))
    assert on.ref_model is not None and not any(p.requires_grad for p in on.ref_model.parameters())


@pytest.mark.timeout(300)
def test_weights_are_published_in_the_publish_dtype(tiny_model: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    engine = TrainEngine(TrainerSettings(model_path=str(tiny_model), publish_dtype="bfloat16"))
    master = engine.full_state_dict() or {}
    out = engine.upload_weights(tmp_path / "w")
    assert out is not None
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            assert all(st.get_tensor(k).dtype == torch.bfloat16 for k in st.keys())
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert reloaded.config.dtype == torch.bfloat16
    for name, p in reloaded.state_dict().items():
        if name in master:
            assert torch.equal(p, master[name].to(torch.bfloat16)), name
