"""The algorithm API: naming an algorithm in config (module or file), what it is given (extra
columns included), and clear errors when a reference or an algorithm's output is unusable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.settings import SettingsError, load_settings
from services.trainer.algorithms import Algorithm, AlgorithmError, LossOutput, Standard, load_algorithm
from services.trainer.algorithms.calls import AlgorithmContractError, attach_advantages, checked_loss, loss_input
from services.trainer.intake.batch import collate, shard
from services.trainer.model.actor import to_tensors
from services.trainer.settings import PPOSettings, TrainerSettings

ROOT = Path(__file__).resolve().parents[2]

SEEN: dict[str, object] = {}

ALGO_FILE = '''
import torch
from services.trainer.algorithms import LossOutput

class Recorder:
    """Per-sample advantages from an extra column; the loss records what it was given."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def advantages(self, batch):
        return batch.columns["bonus"].float() * self.scale

    def loss(self, mb):
        import tests.unit.test_algorithms_api as t
        t.SEEN["columns"] = {k: v.clone() for k, v in mb.columns.items()}
        return LossOutput(loss=-mb.advantages * mb.logp)
'''


def _group(n: int, length: int, seed: int, **extra: np.ndarray) -> dict[str, np.ndarray]:
    ids = np.arange(n * length, dtype=np.int64).reshape(n, length) + seed
    lm = np.zeros_like(ids)
    lm[:, 1:] = 1
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": lm, "logprobs": np.zeros(ids.shape, np.float32),
            "versions": np.zeros_like(ids), "rewards": np.arange(n, dtype=np.float32), **extra}


def test_a_file_algorithm_sees_the_workflows_extra_columns(tmp_path: Path) -> None:
    path = tmp_path / "my_algo.py"
    path.write_text(ALGO_FILE)
    cfg = PPOSettings(algorithm=f"{path}:Recorder", algorithm_kwargs={"scale": 2.0})
    algo = load_algorithm(cfg)
    assert isinstance(algo, Algorithm) and type(algo).__name__ == "Recorder"
    groups = [
        _group(2, 3, 0, bonus=np.array([1.0, 3.0], np.float32), weight=np.array([[1, 2, 3], [4, 5, 6]], np.float32)),
        _group(2, 4, 9, bonus=np.array([0.5, 0.0], np.float32), weight=np.ones((2, 4), np.float32)),
    ]
    batch = collate(groups)
    assert batch["weight"].shape == (4, 4) and batch["weight"][0].tolist() == [1, 2, 3, 0]
    out = attach_advantages(algo, batch, cfg)
    # per-sample advantages from the column (x2), spread over each sample's loss tokens
    assert out["sample_advantages"].tolist() == [2.0, 6.0, 1.0, 0.0]
    assert out["advantages"][1].tolist() == [0.0, 6.0, 6.0, 0.0]
    pieces = shard(out, world_size=1, n_minibatches=2)[0]
    mb = to_tensors(pieces[1])
    logp = torch.zeros(mb["input_ids"].shape, requires_grad=True)
    mb["proximal_logp"] = torch.zeros(mb["input_ids"].shape)  # as the actor adds it (decoupled)
    checked_loss(algo, loss_input(mb, logp, cfg))
    seen = SEEN["columns"]
    assert isinstance(seen, dict)
    assert seen["bonus"].tolist() == [0.5, 0.0] and seen["weight"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]


def test_a_column_missing_from_some_groups_is_left_out_not_misaligned() -> None:
    batch = collate([_group(2, 3, 0, bonus=np.ones(2, np.float32)), _group(2, 3, 1)])
    assert "bonus" not in batch


def test_the_shipped_example_loads_by_module_and_subclasses_standard() -> None:
    cfg = PPOSettings(algorithm="examples.cispo:CISPO", algorithm_kwargs={"eps_high": 0.5})
    algo = load_algorithm(cfg)
    assert isinstance(algo, Standard) and algo.eps_high == 0.5  # type: ignore[attr-defined]
    file_algo = load_algorithm(PPOSettings(algorithm=f"{ROOT / 'examples' / 'cispo.py'}:CISPO"))
    assert type(file_algo).__name__ == "CISPO"


def test_cispo_example_loss_matches_its_formula() -> None:
    cfg = PPOSettings(algorithm="examples.cispo:CISPO", algorithm_kwargs={"eps_low": 0.2, "eps_high": 0.2})
    algo = load_algorithm(cfg)
    logp = torch.log(torch.tensor([[0.9, 0.3, 0.5]])).requires_grad_(True)
    behaviour = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))  # ratios 1.8, 0.6, 1
    mask = torch.tensor([[True, True, True]])
    from services.trainer.algorithms import LossInput

    mb = LossInput(logp=logp, proximal_logp=None, behaviour_logp=behaviour, advantages=torch.tensor([[1.0, -1.0, 2.0]]),
                   loss_mask=mask, ref_logp=None, columns={}, settings=cfg)
    out = algo.loss(mb)
    # -sg(clip(r, 0.8, 1.2)) * A * log p: weights 1.2, 0.8, 1
    assert out.loss.detach().flatten().tolist() == pytest.approx(
        [-1.2 * np.log(0.9), 0.8 * np.log(0.3), -2.0 * np.log(0.5)], rel=1e-5)
    out.loss.sum().backward()
    assert logp.grad is not None and logp.grad.flatten().tolist() == pytest.approx([-1.2, 0.8, -2.0], rel=1e-5)
    assert out.clipped is not None and out.clipped.flatten().tolist() == [True, True, False]


@pytest.mark.parametrize(("ref", "message"), [
    ("no_such_pkg.mod:Name", "cannot import module 'no_such_pkg.mod'"),
    ("examples.cispo:Nope", "has no attribute 'Nope'"),
    ("/nonexistent/algo.py:Name", "no such file"),
    ("examples.copy3:reward", "has no method advantages, loss"),
])
def test_bad_references_name_what_is_wrong(ref: str, message: str) -> None:
    with pytest.raises(AlgorithmError, match=message):
        load_algorithm(PPOSettings(algorithm=ref))


def test_bad_kwargs_and_a_broken_file_are_clear(tmp_path: Path) -> None:
    with pytest.raises(AlgorithmError, match="cannot construct"):
        load_algorithm(PPOSettings(algorithm="examples.cispo:CISPO", algorithm_kwargs={"nope": 1}))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(AlgorithmError, match="failed to load: RuntimeError: boom"):
        load_algorithm(PPOSettings(algorithm=f"{broken}:X"))


def test_an_algorithm_breaking_the_contract_is_named() -> None:
    class Wrong(Standard):
        def advantages(self, batch):  # type: ignore[no-untyped-def]
            return torch.zeros(3, 3, 3)

        def loss(self, mb):  # type: ignore[no-untyped-def]
            return {"loss": mb.logp}

    cfg = PPOSettings()
    batch = collate([_group(2, 3, 0)])
    with pytest.raises(AlgorithmContractError, match=r"Wrong.advantages returned \(3, 3, 3\); expected a tensor shaped \(2,\) or \(2, 3\)"):
        attach_advantages(Wrong(cfg), batch, cfg)
    mb = to_tensors(shard(attach_advantages(Standard(cfg), batch, cfg), 1, 1)[0][0])
    with pytest.raises(AlgorithmContractError, match="expected a LossOutput"):
        checked_loss(Wrong(cfg), loss_input(mb, torch.zeros(2, 3), PPOSettings(decoupled=False)))


def test_settings_of_the_algorithms_validate() -> None:
    s = load_settings(TrainerSettings, overrides=["ppo.policy_loss=gspo", "ppo.eps_clip_high=0.28", "ppo.dual_clip=3",
                                                  "ppo.kl_in=reward", "ppo.kl_estimator=k1", "ppo.adv_norm=reinforce++",
                                                  "ppo.loss_agg=seq-mean-token-sum-norm", "ppo.loss_agg_norm=4"])
    assert s.ppo.policy_loss == "gspo" and s.ppo.loss_agg_norm == 4.0
    for bad, match in ((["ppo.loss_agg=seq-mean-token-sum-norm"], "loss_agg_norm"),
                       (["ppo.overlong_max_tokens=8"], "overlong_buffer"),
                       (["ppo.dual_clip=0.5"], "dual_clip"),
                       (["ppo.algorithm=examples.cispo"], "path/to/file.py:Name"),
                       (["ppo.kl_estimator=k4"], "kl_estimator")):
        with pytest.raises(SettingsError, match=match):
            load_settings(TrainerSettings, overrides=bad)


def test_loss_output_stats_default_to_none() -> None:
    out = LossOutput(loss=torch.zeros(1, 1))
    assert out.clipped is None and out.capped is None and out.imp_weight is None and out.extra == {}
