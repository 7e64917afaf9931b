"""`stochastic_forward`: whether a model's training forward differs from its no-grad forward, which
decides if the first mini-batch may reuse its training forward's log-probs as the proximal ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.model.actor import stochastic_forward
from services.trainer.settings import LoRASettings


def _model(path: Path, **config: float) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **config)


def test_the_tiny_model_has_a_deterministic_forward(tiny_model: Path) -> None:
    assert stochastic_forward(_model(tiny_model)) is None


def test_a_dropout_probability_in_the_model_config_makes_it_stochastic(tiny_model: Path) -> None:
    assert stochastic_forward(_model(tiny_model, attention_dropout=0.1)) == "config.attention_dropout=0.1"


@pytest.mark.parametrize(("p", "stochastic"), [(0.0, False), (0.05, True)])
def test_lora_dropout_makes_it_stochastic_only_when_on(tiny_model: Path, p: float, stochastic: bool) -> None:
    from services.trainer.model import lora

    model = lora.apply(_model(tiny_model), LoRASettings(enabled=True, rank=2, alpha=4, dropout=p))
    reason = stochastic_forward(model)
    assert (reason is not None) == stochastic
    if stochastic:
        assert reason is not None and "lora_dropout" in reason and "p=0.05" in reason


def test_dropout_and_batch_norm_modules_count_and_a_zero_dropout_does_not() -> None:
    assert stochastic_forward(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0))) is None
    assert stochastic_forward(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.2))) == "1 is Dropout(p=0.2)"
    assert "BatchNorm1d" in (stochastic_forward(torch.nn.Sequential(torch.nn.BatchNorm1d(2))) or "")
