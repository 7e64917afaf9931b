"""Sequence packing's bookkeeping: a micro-batch's rows become one row with position ids restarting
per sample, and values computed on it go back to the padded layout (a sample's first token and the
padding get 0); a row with a gap in its attention mask is refused; packed micro-batches are planned
by the sum of their real tokens."""

from __future__ import annotations

import pytest
import torch

from services.trainer.model.micro import plan
from services.trainer.model.packing import KEY, model_inputs, pack, unpack


def _mb() -> dict[str, torch.Tensor]:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    return {"input_ids": torch.arange(12).view(3, 4) + 10, "attention_mask": mask}


def test_rows_are_concatenated_without_padding_and_positions_restart() -> None:
    mb = pack(_mb())
    inputs = model_inputs(mb, torch.device("cpu"))
    assert inputs["input_ids"].tolist() == [[10, 11, 12, 14, 15, 18, 19, 20, 21]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert "attention_mask" not in inputs  # the boundaries are read from the position ids
    assert model_inputs(_mb(), torch.device("cpu"))["attention_mask"].shape == (3, 4)


def test_values_go_back_to_the_padded_layout_with_gradients() -> None:
    mb = pack(_mb())
    values = torch.arange(1.0, 10.0).view(1, 9).requires_grad_(True)
    out = unpack(values, mb)
    assert out.tolist() == [[0, 2, 3, 0], [0, 5, 0, 0], [0, 7, 8, 9]]
    out.sum().backward()
    assert values.grad is not None
    # a sample's first token took its value from the previous sample's logits: no gradient flows there
    assert values.grad.tolist() == [[0, 1, 1, 0, 1, 0, 1, 1, 1]]
    assert unpack(values, _mb()) is values  # a padded micro-batch is left as it is


def test_a_gap_in_the_attention_mask_is_refused_by_name() -> None:
    mb = _mb()
    mb["attention_mask"] = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="row 1's attention_mask has a gap"):
        pack(mb)


def test_packed_micro_batches_are_planned_by_real_tokens() -> None:
    assert plan([4, 1, 1, 4, 9, 2], 10, packed=True) == [[0, 1, 2, 3], [4], [5]]
    assert plan([4, 1, 1, 4, 9, 2], 10) == [[0, 1], [2, 3], [4], [5]]  # padded: rows x longest
    assert KEY not in _mb()
