"""Sequence packing: the rows of a micro-batch concatenated into one row, each sample's position ids
starting again at 0, so the model computes no padding.

The model sees only the packed row (`input_ids` and `position_ids`, no `attention_mask`): transformers
reads the sample boundaries from the position ids, as varlen attention with flash-attention-2 (no
cross-sample attention, no padding) and as a block-diagonal causal mask with sdpa / eager (CPU). The
per-token log-probs and entropy computed on the packed row are put back into the micro-batch's padded
(rows x length) layout before the loss, so the loss, its aggregation (token- or sequence-level) and any
algorithm see exactly the tensors of the padded path: the same numbers, only the forward is packed.

With `share_prompts` the samples of one prompt share a single copy of it in the row, under a 4-D
attention mask (services.trainer.model.prompt_tree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.trainer.model import prompt_tree
from services.trainer.model.rounding import rounded

KEY = "_packed"
"""Where a packed micro-batch keeps its `Packed` (beside its padded columns, which the loss uses)."""


@dataclass(frozen=True)
class Packed:
    """One packed row and the way back to the padded layout."""

    input_ids: torch.Tensor
    """(1, L): the samples' tokens, back to back (then the padding that rounds L up, if any)."""
    position_ids: torch.Tensor
    """(1, L): 0..n_i - 1 per sample (and per the padding)."""
    index: torch.Tensor
    """(L,): for each packed token, its flat index in the padded (rows x length) layout."""
    kept: torch.Tensor
    """(K,): the packed positions whose values go back (every sample's tokens but its first)."""
    shape: tuple[int, int]
    """The padded layout's (rows, length)."""
    tree: prompt_tree.Tree | None = None
    """With shared prompts: the attention mask and where each answer token's log-prob comes from and
    goes (`index` and `kept` are then unused)."""


def lengths(mb: dict[str, Any]) -> list[int]:
    """Each row's token count; raises if a row's attention mask is not ones then zeros (right
    padding): packing takes each row's first `length` tokens."""
    mask = mb["attention_mask"] != 0
    n = mask.sum(-1)
    prefix = torch.arange(mask.shape[1]).unsqueeze(0) < n.unsqueeze(1)
    if not torch.equal(mask, prefix):
        bad = int((mask != prefix).any(-1).nonzero()[0, 0])
        raise ValueError(f"pack_sequences: row {bad}'s attention_mask has a gap (packing needs right padding only)")
    return [int(x) for x in n.tolist()]


def pack(mb: dict[str, Any], *, share_prompts: bool = False, rounding: float = 0.0) -> dict[str, Any]:
    """`mb` with its `Packed` row attached under `KEY` (its padded columns kept for the loss);
    `share_prompts`: each distinct prompt once in the row (services.trainer.model.prompt_tree).
    `rounding`: the row's length is rounded up (`rounded`), the extra tokens (id 0) a sample of their
    own at the end whose outputs are never read: the model sees a few shapes, not a new one per step
    (`TrainerSettings.pack_rounding`)."""
    ids = mb["input_ids"]
    rows, width = int(ids.shape[0]), int(ids.shape[1])
    sizes = lengths(mb)
    if share_prompts:
        tokens, positions, tree = prompt_tree.layout(mb, sizes, width, rounding)
        out = dict(mb)
        none = torch.zeros(0, dtype=torch.long)
        out[KEY] = Packed(input_ids=tokens.unsqueeze(0), position_ids=positions.unsqueeze(0), index=none, kept=none,
                          shape=(rows, width), tree=tree)
        return out
    index = torch.cat([torch.arange(n) + r * width for r, n in enumerate(sizes)])
    positions = torch.cat([torch.arange(n) for n in sizes])
    kept = (positions > 0).nonzero().squeeze(-1)
    tokens = ids.reshape(-1)[index]
    extra = rounded(int(tokens.numel()), rounding) - int(tokens.numel())
    if extra:  # a sample of padding after the real ones: outside `kept`, so nothing of it goes back
        tokens = torch.cat([tokens, torch.zeros(extra, dtype=tokens.dtype)])
        positions = torch.cat([positions, torch.arange(extra)])
    out = dict(mb)
    out[KEY] = Packed(input_ids=tokens.unsqueeze(0), position_ids=positions.unsqueeze(0),
                      index=index, kept=kept, shape=(rows, width))
    return out


def model_inputs(mb: dict[str, Any], device: torch.device, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """What the model is called with: the packed row and its position ids when `mb` is packed (and
    with shared prompts its 4-D attention mask in the model's `dtype`), else the padded rows and their
    attention mask. Never a KV cache: training needs none, and transformers reads packed boundaries
    from the position ids only when there is none."""
    packed: Packed | None = mb.get(KEY)
    if packed is not None:
        out = {"input_ids": packed.input_ids.to(device).long(), "position_ids": packed.position_ids.to(device).long(),
               "use_cache": False}
        if packed.tree is not None:
            out["attention_mask"] = prompt_tree.attention_mask(packed.tree, device, dtype)
        return out
    return {"input_ids": mb["input_ids"].to(device).long(), "attention_mask": mb["attention_mask"].to(device).long(),
            "use_cache": False}


def tree_of(mb: dict[str, Any]) -> prompt_tree.Tree | None:
    """The shared-prompt layout of a packed `mb`, or None (padded, or packed the plain way)."""
    packed: Packed | None = mb.get(KEY)
    return packed.tree if packed is not None else None


def target_ids(mb: dict[str, Any]) -> torch.Tensor:
    """The ids the log-probs are taken of, in the layout of the logits: (1, L) packed or (rows, length)."""
    packed: Packed | None = mb.get(KEY)
    return packed.input_ids if packed is not None else mb["input_ids"]


def unpack(values: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
    """Per-token values computed on the packed row (1, L), aligned with its tokens like
    `logp_from_logits` (value t from the logits at t - 1), in the padded (rows, length) layout: each
    sample's first token gets 0 (its packed value came from the previous sample's last logits), as
    do the padding positions. Differentiable; a padded `mb` is returned as it is."""
    packed: Packed | None = mb.get(KEY)
    if packed is None:
        return values
    flat = values.reshape(-1)
    # Integer indices made with the packing (on the CPU), not a boolean mask here: on a GPU a mask's
    # index waits for the device to count it, twice per micro-batch.
    kept = packed.kept.to(flat.device)
    out = flat.new_zeros(packed.shape[0] * packed.shape[1])
    out = out.index_put((packed.index.to(flat.device)[kept],), flat.index_select(0, kept))
    return out.view(packed.shape)
