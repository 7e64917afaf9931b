"""The LR schedule's multiplier per optimizer step, and the settings that define it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.trainer.model.schedule import lr_factor
from services.trainer.settings import TrainerSettings


def test_warmup_then_decay_to_the_floor() -> None:
    assert [lr_factor(i, "constant", 4, 0, 0.0) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_factor(i, "linear", 0, 4, 0.0) for i in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert lr_factor(2, "cosine", 0, 4, 0.2) == pytest.approx(0.6)  # halfway: the mean of 1 and the floor
    assert lr_factor(100, "cosine", 0, 4, 0.2) == pytest.approx(0.2)


def test_a_decaying_schedule_needs_its_length() -> None:
    with pytest.raises(ValidationError, match="lr_decay_steps or total_steps"):
        TrainerSettings(lr_schedule="cosine")
    assert TrainerSettings(lr_schedule="cosine", total_steps=10).lr_schedule == "cosine"
    with pytest.raises(ValidationError):
        TrainerSettings(max_tokens_per_microbatch=-1)
