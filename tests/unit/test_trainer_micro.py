"""Cutting a rank's mini-batch piece into micro-batches by a token budget: every row once, in order,
within the budget (a longer row alone), trimmed to its own padding; widened for ZeRO-3's equal passes."""

from __future__ import annotations

import torch

from services.trainer.model.micro import merge_stats, plan, split, widen


def test_rows_are_grouped_in_order_within_the_budget() -> None:
    assert plan([4, 4, 4, 4, 9, 2], 10) == [[0, 1], [2, 3], [4], [5]]
    assert plan([4, 4, 4], 0) == [[0, 1, 2]]
    assert plan([30, 1], 10) == [[0], [1]]  # a row over the budget goes alone


def test_widening_halves_the_largest_group_then_adds_empty_ones() -> None:
    assert widen([[0, 1, 2, 3]], 3) == [[0], [1], [2, 3]]
    assert widen([[0]], 3) == [[0], [], []]


def test_split_trims_padding_and_an_empty_group_carries_no_loss_tokens() -> None:
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    mb = {"input_ids": torch.arange(8).view(2, 4), "attention_mask": mask, "loss_mask": mask.clone(),
          "weight": torch.tensor([0.5, 2.0]), "total_tokens": 6.0}
    first, second, empty = split(mb, [[0], [1], []])
    assert first["input_ids"].tolist() == [[0, 1, 2, 3]]
    assert second["input_ids"].tolist() == [[4, 5]] and second["weight"].tolist() == [2.0]
    assert second["total_tokens"] == 6.0  # the mini-batch's global count travels with each part
    assert empty["loss_mask"].sum() == 0
    assert split(mb, [[0, 1]]) == [mb]


def test_micro_batch_stats_are_summed_and_maxima_kept() -> None:
    assert merge_stats([{"loss": 1.0, "imp_weight_max": 2.0}, {"loss": 0.5, "imp_weight_max": 1.5}]) == {"loss": 1.5, "imp_weight_max": 2.0}
