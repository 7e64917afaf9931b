"""Micro-batches: a rank's piece of a mini-batch cut into row groups of at most a token budget
(rows x padded length, or the sum of the rows' lengths when packed), each trimmed to its own longest
row, trained with gradient accumulation.

Every micro-batch carries the mini-batch's global `total_tokens` / `total_seqs`, so each one's loss is
its share of the mini-batch's loss and their sum (the accumulated gradient) is the one-pass value."""

from __future__ import annotations

from typing import Any

import torch


def _rows(mb: dict[str, Any], idx: list[int], n: int) -> dict[str, Any]:
    length = max(int(mb["attention_mask"][idx].sum(-1).max()), 1) if idx else 1
    out: dict[str, Any] = {}
    for k, v in mb.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n:
            v = v[idx]
            out[k] = v[:, :length] if v.dim() == 2 else v
        else:
            out[k] = v
    return out


def plan(lengths: list[int], budget: int, *, packed: bool = False) -> list[list[int]]:
    """Row indices of each micro-batch, in order: rows are added while the micro-batch's tokens stay
    within budget: rows x longest (padded), or the sum of the lengths when `packed` (a row longer than
    the budget goes alone). `budget` 0 is one micro-batch of every row."""
    if budget <= 0 or not lengths:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = [[]]
    longest = total = 0
    for i, n in enumerate(lengths):
        cost = total + n if packed else (len(groups[-1]) + 1) * max(longest, n)
        if groups[-1] and cost > budget:
            groups.append([])
            longest = total = 0
        groups[-1].append(i)
        longest, total = max(longest, n), total + n
    return groups


def widen(groups: list[list[int]], count: int) -> list[list[int]]:
    """`groups` split further until there are `count` (ranks must run the same number of forward
    passes under ZeRO-3): the largest group is halved; past one row per group, empty groups follow."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        big = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[big]) < 2:
            groups.append([])
            continue
        half = len(groups[big]) // 2
        groups[big : big + 1] = [groups[big][:half], groups[big][half:]]
    return groups


def split(mb: dict[str, Any], groups: list[list[int]]) -> list[dict[str, Any]]:
    """The micro-batches of `mb` for `groups`; an empty group becomes the first row with no loss
    tokens (a forward and a zero gradient, so every rank runs the same passes)."""
    n = int(mb["input_ids"].shape[0])
    if len(groups) == 1 and groups[0] == list(range(n)):
        return [mb]
    out = []
    for g in groups:
        part = _rows(mb, g or [0], n)
        if not g:
            part["loss_mask"] = torch.zeros_like(part["loss_mask"])
        out.append(part)
    return out


def merge_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One mini-batch's stats from its micro-batches': sums (each loss is already a share of the
    mini-batch's), maxima for `*_max`. Floats or scalar tensors (left on their device: merged without
    reading them back)."""
    out: dict[str, Any] = {}
    for s in stats:
        for k, v in s.items():
            if k not in out:
                out[k] = v
            elif k.endswith("_max"):
                out[k] = torch.maximum(out[k], v) if isinstance(v, torch.Tensor) else max(out[k], v)
            else:
                out[k] = out[k] + v
    return out
