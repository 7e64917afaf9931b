"""Shared prompts: a packed micro-batch in which the samples of one prompt (a group) share a single
copy of its tokens.

A GRPO group is 8 or 16 answers to one prompt; packed the plain way, each carries the prompt again and
the model computes it once per sample. For a short-answer task the prompt is most of the tokens (a chat
template's system turn plus the question: ~60 tokens against answers of ~15). Here the packed row holds
each distinct prompt once, then each of its answers:

    [prompt A][answer A1][answer A2]...[prompt B][answer B1]...

with position ids continuing the prompt in every answer and a 4-D attention mask (sdpa / eager; not
flash-attention-2, which reads sample boundaries from position ids) under which an answer token sees
its prompt and its own earlier tokens, never another answer. Every answer token computes exactly what it
computes in its own padded row (the same keys, values and positions), so the log-probs, loss and
gradients are the padded path's; the gradient of the shared prompt is the sum over its answers, as
autograd adds it.

A row's prompt is its tokens before its first loss token (`loss_mask`); rows with identical prompt
tokens in one micro-batch share it. The log-probs are computed for answer tokens only (the pairs
below); a prompt token's value is 0, which is what every loss reads there (the loss mask is 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.trainer.model.rounding import rounded


@dataclass(frozen=True)
class Tree:
    """The shared layout of one packed row: which tokens may attend to which, and where each answer
    token's log-prob comes from and goes."""

    allowed: torch.Tensor
    """(L, L) bool: query i may attend to key j."""
    src: torch.Tensor
    """(K',): for each answer token, the packed position whose output predicts it (its previous token,
    the prompt's last for an answer's first token); K' >= K: rounded up like the row (see `layout`),
    the extra entries reading position 0 and ignored."""
    targets: torch.Tensor
    """(K',): those answer tokens' ids (0 for the extra entries)."""
    dest: torch.Tensor
    """(K,): the answer tokens' flat indices in the padded (rows x length) layout."""


def prompt_lengths(mb: dict[str, Any], sizes: list[int]) -> list[int]:
    """Each row's prompt length: the index of its first loss token (its whole length when it has none)."""
    trained = mb["loss_mask"] != 0
    first = torch.where(trained.any(-1), trained.int().argmax(-1), torch.tensor(sizes))
    return [min(int(p), n) for p, n in zip(first.tolist(), sizes, strict=True)]


def prompt_keys(mb: dict[str, Any], sizes: list[int]) -> list[tuple[bytes, int]]:
    """Each row's (prompt tokens as bytes, prompt length): rows with the same key share a prompt."""
    ids = mb["input_ids"]
    return [(ids[r, :p].numpy().tobytes(), p) for r, p in enumerate(prompt_lengths(mb, sizes))]


def plan(keys: list[tuple[bytes, int]], sizes: list[int], budget: int) -> list[list[int]]:
    """`services.trainer.model.micro.plan` for packed rows with shared prompts: rows are added in order
    while the micro-batch's tokens stay within `budget`, a row whose prompt is already in the
    micro-batch costing its answer only (a row longer than the budget goes alone; 0: one micro-batch)."""
    if budget <= 0 or not sizes:
        return [list(range(len(sizes)))]
    groups: list[list[int]] = [[]]
    seen: set[bytes] = set()
    total = 0
    for i, ((key, p), n) in enumerate(zip(keys, sizes, strict=True)):
        cost = n - p if key in seen and p > 0 else n
        if groups[-1] and total + cost > budget:
            groups.append([])
            seen, total, cost = set(), 0, n
        groups[-1].append(i)
        seen.add(key)
        total += cost
    return groups


def layout(mb: dict[str, Any], sizes: list[int], width: int, rounding: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, Tree]:
    """(packed ids (L,), position ids (L,), the tree) of a right-padded micro-batch whose rows have
    `sizes` tokens, in a padded layout `width` wide. `rounding`: L and the answer tokens' count K are
    rounded up (`rounded`: the shapes the model and the output projection see), the extra tokens a
    causal segment of their own at the end that no other token attends to."""
    ids = mb["input_ids"]
    keys = prompt_keys(mb, sizes)
    tokens: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    segment: list[int] = []  # each packed token's segment
    parent: list[int] = []  # each segment's prompt segment (itself for a prompt or a row without one)
    prompt_at: dict[bytes, tuple[int, int]] = {}  # prompt key -> (its segment, its first packed position)
    src, targets, dest = [], [], []
    offset = 0
    for r, ((key, p), n) in enumerate(zip(keys, sizes, strict=True)):
        if p > 0 and key not in prompt_at:
            prompt_at[key] = (len(parent), offset)
            parent.append(len(parent))
            tokens.append(ids[r, :p])
            positions.append(torch.arange(p))
            segment += [prompt_at[key][0]] * p
            offset += p
        own = len(parent)
        parent.append(prompt_at[key][0] if p > 0 else own)
        tokens.append(ids[r, p:n])
        positions.append(torch.arange(p, n))
        segment += [own] * (n - p)
        start = offset
        offset += n - p
        # token t (>= 1) of the row is predicted by token t - 1: in the shared prompt or in the answer
        for t in range(max(p, 1), n):
            src.append(prompt_at[key][1] + t - 1 if t - 1 < p else start + t - 1 - p)
            targets.append(int(ids[r, t]))
            dest.append(r * width + t)
    extra = rounded(offset, rounding) - offset
    if extra:  # the padding: token 0 at positions 0.., its own segment (each pad token sees the pads before it)
        parent.append(len(parent))
        tokens.append(torch.zeros(extra, dtype=ids.dtype))
        positions.append(torch.arange(extra))
        segment += [parent[-1]] * extra
        offset += extra
    answers = len(src)
    src += [0] * (rounded(answers, rounding) - answers)  # extra output rows, read from position 0, never scattered back
    targets += [0] * (rounded(answers, rounding) - answers)
    seg = torch.tensor(segment, dtype=torch.long)
    up = torch.tensor(parent, dtype=torch.long)[seg]
    order = torch.arange(offset)
    causal = order.unsqueeze(0) <= order.unsqueeze(1)
    allowed = causal & ((seg.unsqueeze(0) == seg.unsqueeze(1)) | (seg.unsqueeze(0) == up.unsqueeze(1)))
    tree = Tree(allowed=allowed, src=torch.tensor(src, dtype=torch.long), targets=torch.tensor(targets, dtype=torch.long),
                dest=torch.tensor(dest, dtype=torch.long))
    return torch.cat(tokens), torch.cat(positions), tree


def attention_mask(tree: Tree, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The (1, 1, L, L) additive mask transformers takes as given (a 4-D mask is used as it is): 0 where
    attention is allowed, the dtype's lowest value elsewhere (eager adds it; sdpa adds a float mask)."""
    allowed = tree.allowed.to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, *allowed.shape)


def scatter(values: torch.Tensor, tree: Tree, shape: tuple[int, int]) -> torch.Tensor:
    """Per-answer-token values (K', `tree.src`'s order; the extra entries past K dropped) in the padded
    (rows, length) layout, 0 elsewhere. Differentiable."""
    out = values.new_zeros(shape[0] * shape[1])
    return out.index_put((tree.dest.to(values.device),), values[: tree.dest.numel()]).view(shape)
