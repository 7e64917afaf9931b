"""One PPO update of the real DeepSpeed engine (one CPU rank) on fixed groups, with what it did:
the trainer tests compare two such updates (micro-batches, packing, proximal log-probs, LoRA...)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.trainer.intake.batch import collate, shard
from services.trainer.model.actor import PPOActor
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from tests.support.trainer import make_group


def uneven_groups(model: Path) -> list[dict[str, np.ndarray]]:
    groups = [make_group(model, d, group_size=4, seed=i) for i, d in enumerate(["123", "405", "777"])]
    for i, g in enumerate(groups):
        g["logprobs"] = (g["logprobs"] * (1.0 + 0.1 * (i + 1))).astype("float32")  # the decoupled weight matters
        # uneven lengths, so micro-batches trim different amounts of padding
        g["attention_mask"][i, -i - 1 :] = 0
        g["loss_mask"][i, -i - 1 :] = 0
    return groups


def probed_piece(model: Path, **settings: Any) -> tuple[TrainEngine, PPOActor, dict[str, Any], list[dict[str, Any]], Any]:
    """(engine, actor, one piece of `uneven_groups`, the keyword arguments of every model call from
    now on, the model's own forward) for a one-rank trainer with `settings`."""
    from services.trainer.model.actor import to_tensors

    s = TrainerSettings(model_path=str(model), **settings)
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    piece = to_tensors(shard(actor.compute_advantages(collate(uneven_groups(model))), 1, 1)[0][0])
    seen: list[dict[str, Any]] = []
    forward = engine.engine.forward

    def probed(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return forward(*args, **kwargs)

    engine.engine.forward = probed
    return engine, actor, piece, seen, forward


def one_update(model: Path, **settings: Any) -> tuple[dict[str, float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor], int]:
    """(stats, grads before each optimizer step, weights after, forward passes) of one update."""
    from deepspeed.utils import safe_get_full_grad

    ppo = {"n_minibatches": 2, "kl_coef": 0.01, **settings.pop("ppo", {})}
    s = TrainerSettings(model_path=str(model), seed=0, ppo=ppo, **settings)
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    grads: list[dict[str, torch.Tensor]] = []
    passes = [0]
    # Read the accumulated gradients the optimizer is about to use, before clipping: in DeepSpeed's
    # step, or without ZeRO before the trainer's own clip.
    probed, attr = (engine, "_clip") if engine.grads_in_params else (engine.engine, "step")
    inner, forward = getattr(probed, attr), engine.engine.forward

    def probed_step() -> Any:
        grads.append({n: safe_get_full_grad(p).detach().clone() for n, p in engine.engine.module.named_parameters()})
        return inner()

    def counted_forward(*args: Any, **kwargs: Any) -> Any:
        passes[0] += 1
        return forward(*args, **kwargs)

    setattr(probed, attr, probed_step)
    engine.engine.forward = counted_forward
    batch = actor.compute_advantages(collate(uneven_groups(model)))
    stats = actor.ppo_update(shard(batch, 1, 2)[0])
    weights = engine.full_state_dict() or {}
    return stats, grads, weights, passes[0]


def assert_same_update(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    for key in ("loss", "pg_loss", "entropy", "kl", "train_tokens", "clip_fraction", "imp_weight_mean"):
        assert a[0][key] == pytest.approx(b[0][key], abs=1e-5), key
    assert math.isfinite(a[0]["grad_norm"]) and a[0]["grad_norm"] == pytest.approx(b[0]["grad_norm"], rel=1e-4)
    assert len(a[1]) == len(b[1]) == 2
    for ga, gb in zip(a[1], b[1], strict=True):
        for name in ga:
            assert torch.allclose(ga[name], gb[name], atol=1e-5), name
    for name in a[2]:
        assert torch.allclose(a[2][name], b[2][name], atol=1e-5), name
