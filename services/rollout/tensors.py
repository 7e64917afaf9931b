"""Padded tensor dicts: one sample from its tokens, and a group from samples.

The contract (docs/design.md "A trajectory message"): batch-first, right-padded, `input_ids` int64,
`attention_mask` int64, `loss_mask` int64 (1 where the loss applies: generated tokens), `logprobs`
float32 (0 on prompt tokens), `versions` int64 (-1 on prompt tokens), `rewards` float32 (one per
sample), `prompt_len` int64 (one per sample). Padding is 0 everywhere. Only the trained tokens'
versions matter downstream (staleness): a workflow that tags its prompt tokens 0, as AReaL's
examples do, builds an equally valid group.

torch is imported on first use, not with the module: the worker runs the built-in workflows (which
build their groups with numpy, `groups.py`) without it, and importing it costs a worker ~1.5 CPU-s
at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

TensorDict = dict[str, Any]
Segment = tuple[Sequence[int], bool, Sequence[float] | None, Sequence[int] | None]
"""Part of one sample: `(ids, generated, logprobs, versions)`; logprobs and versions of a generated part."""


def sample_tensors(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    output_logprobs: Sequence[float],
    output_versions: Sequence[int],
    reward: float,
) -> TensorDict:
    """One sample (batch 1): the prompt, then the generated tokens."""
    if not (len(output_ids) == len(output_logprobs) == len(output_versions)):
        raise ValueError(
            f"output_ids ({len(output_ids)}), output_logprobs ({len(output_logprobs)}) and "
            f"output_versions ({len(output_versions)}) must have the same length"
        )
    return turn_tensors(
        [(list(prompt_ids), False, None, None), (list(output_ids), True, output_logprobs, output_versions)],
        reward,
        len(prompt_ids),
    )


def turn_tensors(segments: Sequence[Segment], reward: float, prompt_len: int) -> TensorDict:
    """One sample built from segments `(ids, generated, logprobs, versions)`: generated segments are
    trained on (loss_mask 1) and carry their logprobs and versions; the others (prompt, feedback) do not."""
    import torch

    ids: list[int] = []
    loss: list[int] = []
    logp: list[float] = []
    vers: list[int] = []
    for seg_ids, generated, seg_logp, seg_vers in segments:
        n = len(seg_ids)
        ids.extend(seg_ids)
        loss.extend([1 if generated else 0] * n)
        logp.extend(seg_logp if generated and seg_logp is not None else [0.0] * n)
        vers.extend(seg_vers if generated and seg_vers is not None else [-1] * n)
    return {
        "input_ids": torch.tensor([ids], dtype=torch.int64),
        "attention_mask": torch.ones((1, len(ids)), dtype=torch.int64),
        "loss_mask": torch.tensor([loss], dtype=torch.int64),
        "logprobs": torch.tensor([logp], dtype=torch.float32),
        "versions": torch.tensor([vers], dtype=torch.int64),
        "rewards": torch.tensor([reward], dtype=torch.float32),
        "prompt_len": torch.tensor([prompt_len], dtype=torch.int64),
    }


def _as_tensor(key: str, value: Any) -> torch.Tensor:
    import torch

    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{key}: not an array ({type(value).__name__}): {exc}") from exc


def concat_padded(samples: Sequence[TensorDict]) -> TensorDict:
    """Concatenate padded tensor dicts along the batch, right-padding token columns with 0 to the
    longest sequence. Every dict must have the same keys; numpy arrays are accepted."""
    import torch

    if not samples:
        raise ValueError("concat_padded: no samples")
    keys = list(samples[0])
    for i, s in enumerate(samples[1:], start=1):
        if set(s) != set(keys):
            raise ValueError(f"concat_padded: sample {i} has keys {sorted(s)}, sample 0 has {sorted(keys)}")
    tensors = [{k: _as_tensor(k, s[k]) for k in keys} for s in samples]
    if "attention_mask" not in keys:
        raise ValueError("concat_padded: attention_mask is required to tell token columns from sample columns")
    seqlen = max(int(t["attention_mask"].shape[1]) for t in tensors)
    out: TensorDict = {}
    for key in keys:
        parts = []
        for t in tensors:
            value = t[key]
            width = int(t["attention_mask"].shape[1])
            if value.dim() == 2 and value.shape[1] == width and width < seqlen:
                value = torch.nn.functional.pad(value, (0, seqlen - width), value=0)
            parts.append(value)
        try:
            out[key] = torch.cat(parts, dim=0)
        except RuntimeError as exc:
            raise ValueError(f"concat_padded: {key}: shapes {[tuple(p.shape) for p in parts]} do not stack") from exc
    return out


def group_sizes(tensors: TensorDict) -> tuple[int, int]:
    """(samples, generated tokens) of a padded tensor dict (torch or numpy), for throughput metrics."""
    loss = tensors["loss_mask"]
    if hasattr(loss, "detach"):  # torch, without importing it
        loss = loss.detach().cpu().numpy()
    loss = np.asarray(loss)
    return int(loss.shape[0]), int(np.count_nonzero(loss))
