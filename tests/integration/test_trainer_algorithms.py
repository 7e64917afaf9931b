"""Algorithms in the real trainer: the built-ins that change what the actor does (GSPO, REINFORCE++
with KL in the reward, clip-higher + dual clip + Dr.GRPO's normaliser) train a real DeepSpeed engine
on copy3 groups; and the one-file custom algorithm of examples/cispo.py, named by its file path,
trains copy3 in the whole stack (`jetrl up`: nats-server, inference server + weights agent, reward
service, rollout workers, DeepSpeed trainer) and its reward rises."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.trainer.intake.batch import collate, shard
from services.trainer.model.actor import PPOActor
from services.trainer.model.collective import Command, execute
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from tests.support.trainer import make_group
from tests.support.up import finish, left_behind, start_up

ROOT = Path(__file__).resolve().parents[2]

RECORDER = '''
import torch
from services.trainer.algorithms import LossOutput, Standard

class Weighted(Standard):
    """GRPO's loss, each sample scaled by the workflow's per-sample `weight` column; reports it."""

    def loss(self, mb):
        out = super().loss(mb)
        w = mb.columns["weight"].float()[:, None].expand_as(mb.logp)
        return LossOutput(loss=out.loss * w, clipped=out.clipped, extra={"weight": w})
'''

CASES: list[tuple[str, dict[str, Any]]] = [
    ("gspo", {"policy_loss": "gspo", "eps_clip": 4e-4, "loss_agg": "seq-mean-token-mean"}),
    ("reinforce++", {"adv_norm": "reinforce++", "kl_coef": 0.01, "kl_in": "reward", "kl_estimator": "k1"}),
    ("dapo+dual+drgrpo", {"adv_norm": "drgrpo", "eps_clip_high": 0.28, "dual_clip": 3.0, "kl_coef": 0.01, "kl_estimator": "k2",
                          "loss_agg": "seq-mean-token-sum-norm", "loss_agg_norm": 4, "overlong_max_tokens": 3, "overlong_buffer": 1}),
]


def _groups(model: Path) -> list[dict[str, np.ndarray]]:
    groups = [make_group(model, d, group_size=4, seed=i) for i, d in enumerate(["123", "405", "777"])]
    for i, g in enumerate(groups):
        g["logprobs"] = (g["logprobs"] * (1.0 + 0.1 * (i + 1))).astype("float32")  # the decoupled weight matters
        g["weight"] = np.array([1.0, 0.5, 2.0, 0.0], np.float32)
    return groups


def _train(model: Path, ppo: dict[str, Any]) -> tuple[dict[str, float], float]:
    s = TrainerSettings(model_path=str(model), zero_stage=2, seed=0, ppo={"n_minibatches": 2, **ppo})
    engine = TrainEngine(s)
    actor = PPOActor(engine, s.ppo)
    before = {k: v.clone() for k, v in (engine.full_state_dict() or {}).items()}
    batch = actor.compute_advantages(collate(_groups(model)))
    res = execute(engine, actor, Command("train", pieces=shard(batch, 1, 2)[0]))
    after = engine.full_state_dict() or {}
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    return res.stats, moved


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "ppo"), CASES, ids=[c[0] for c in CASES])
def test_built_in_algorithms_train_the_real_engine(tiny_model: Path, name: str, ppo: dict[str, Any]) -> None:
    stats, moved = _train(tiny_model, ppo)
    assert moved > 0, f"{name}: the weights did not change"
    assert all(math.isfinite(stats[k]) for k in ("loss", "pg_loss", "entropy", "kl", "grad_norm")), stats
    if name == "dapo+dual+drgrpo":
        assert stats["kl"] > 0  # k2 in the loss, against the reference model
    if name == "reinforce++":
        assert stats["kl"] == 0  # the KL went into the reward, not the loss


@pytest.mark.timeout(300)
def test_a_file_algorithm_trains_the_real_engine_with_an_extra_column(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "weighted.py"
    path.write_text(RECORDER)
    stats, moved = _train(tiny_model, {"algorithm": f"{path}:Weighted"})
    assert moved > 0
    # the mean over loss tokens of the per-sample weights (each group: 1, 0.5, 2, 0 on equally long samples)
    assert stats["algo_weight"] == pytest.approx(3.5 / 4, rel=1e-5)
    assert torch.isfinite(torch.tensor(stats["loss"]))


STEPS = 50


@pytest.mark.timeout(1200)
def test_one_file_custom_algorithm_learns_copy3_in_the_real_stack(tmp_path: Path) -> None:
    algorithm = f"{ROOT / 'examples' / 'cispo.py'}:CISPO"
    # a higher learning rate than the demo's 1e-3, so a modest number of steps shows the rise
    config = {"trainer": {"eta": 4, "lr": 3e-3, "checkpoint_every": 0, "ppo": {"algorithm": algorithm}}, "rollout": {"ack_wait_s": 15}}
    proc = start_up(tmp_path, "cispo", STEPS, config)
    out = finish(proc, timeout=1100)
    assert proc.returncode == 0, out[-4000:]
    assert left_behind(tmp_path) == []
    history = json.loads((tmp_path / "cispo" / "metrics.json").read_text())["steps"]
    assert [s["step"] for s in history][-1] == STEPS
    # the custom loss ran: it reports its importance ratios, which only examples/cispo.py emits
    assert all("algo_is_ratio" in s for s in history), sorted(history[-1])
    first = sum(s["reward_mean"] for s in history[:8]) / 8
    last = sum(s["reward_mean"] for s in history[-8:]) / 8
    # from chance (~0.02) a rise of 0.05 over 50 steps is far beyond the 8-step means' noise (~0.01)
    assert last > first + 0.05, f"reward did not rise: first 8 steps {first:.3f}, last 8 {last:.3f}"
