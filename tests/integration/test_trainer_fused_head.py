"""The output projection folded into the chunked log-prob function, on the real DeepSpeed engine
(one CPU rank): the tiny model's embedding is tied to its output projection, and the update (loss,
gradients, weights) is the same with and without the fusion while the whole-vocabulary logits are
never computed (the model's own projection runs on the last position only); ZeRO-3 and a LoRA-wrapped
output projection fall back to the logits; LoRA with a frozen projection trains fused."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.intake.batch import collate, shard
from services.trainer.model.actor import PPOActor
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from tests.support.updates import assert_same_update, one_update, uneven_groups


@contextmanager
def logit_positions(vocab: int) -> Iterator[list[int]]:
    """Positions per row of every (.., positions, vocab)-shaped output a Linear computes in training mode in the block:
    the training forwards' logits (not the frozen reference model's, nor no-grad passes in eval mode)."""
    seen: list[int] = []

    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        if isinstance(module, torch.nn.Linear) and module.training and isinstance(out, torch.Tensor) and out.shape[-1] == vocab:
            seen.append(int(out.shape[-2]))

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def _vocab(model: Path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    assert config.tie_word_embeddings  # the case where the gradient must reach the shared weight
    return int(config.vocab_size)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("keep_mb", [0, 256], ids=["recomputed", "kept"])  # the probabilities for the backward pass
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_fused_projection_gives_the_same_update_without_whole_vocabulary_logits(tiny_model: Path, stage: int,
                                                                                   keep_mb: float) -> None:
    real = {"zero_stage": stage, "fused_keep_probs_mb": keep_mb,
            "logp_chunk_tokens": 5, "max_tokens_per_microbatch": 30, "pack_sequences": True,
            "gradient_checkpointing": True, "ppo": {"temperature": 0.8}}
    vocab = _vocab(tiny_model)
    with logit_positions(vocab) as logits_positions:
        plain = one_update(tiny_model, fused_output_projection=False, **real)
    with logit_positions(vocab) as fused_positions:
        fused = one_update(tiny_model, **real)
    assert_same_update(plain, fused)
    assert max(logits_positions) > 1
    if stage != 3:
        assert fused_positions and max(fused_positions) == 1  # only the last position's logits, from the model
    else:  # ZeRO-3 partitions the projection's weight: the logits path, as before
        assert max(fused_positions) > 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_lora_trains_with_the_fused_projection_or_falls_back_when_the_projection_is_wrapped(tiny_model: Path, targets: list[str]) -> None:
    s = TrainerSettings(model_path=str(tiny_model), lr=1e-2, logp_chunk_tokens=5,
                        lora={"enabled": True, "rank": 2, "alpha": 4, "target_modules": targets})
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    assert (actor.head is None) == ("lm_head" in targets)
    before = {n: p.detach().clone() for n, p in engine.engine.module.named_parameters()}
    batch = actor.compute_advantages(collate(uneven_groups(tiny_model)))
    with logit_positions(_vocab(tiny_model)) as rows:
        stats = actor.ppo_update(shard(batch, 1, 1)[0])
    assert torch.isfinite(torch.tensor(stats["loss"]))
    assert rows and (max(rows) > 1) == ("lm_head" in targets)  # fused: the model's logits at the last position only
    after = dict(engine.engine.module.named_parameters())
    changed = {n for n, p in before.items() if not torch.equal(p, after[n].detach())}
    assert changed and all(".lora_B." in n or ".lora_A." in n for n in changed)
    assert any(".lora_B." in n for n in changed)
