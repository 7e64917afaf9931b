"""From decoded groups to what each rank trains on: collate the groups of a step into one padded
batch, attach per-token advantages (group normalisation needs whole groups, so rank 0 does it), and
cut the batch into each rank's mini-batch pieces with the global counts the loss divides by."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from services.trainer.ppo import group_advantages

TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")


def collate(groups: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Pad every group to the longest sequence and stack them; adds `group_index` per sample."""
    if not groups:
        raise ValueError("collate: no groups")
    seqlen = max(g["input_ids"].shape[1] for g in groups)
    out: dict[str, list[np.ndarray]] = {k: [] for k in (*TOKEN_KEYS, "rewards", "group_index")}
    for gi, g in enumerate(groups):
        n, length = g["input_ids"].shape
        for key in TOKEN_KEYS:
            arr = np.zeros((n, seqlen), dtype=g[key].dtype)
            arr[:, :length] = g[key]
            if key == "versions":
                arr[:, length:] = -1
            out[key].append(arr)
        out["rewards"].append(np.asarray(g["rewards"], dtype=np.float32))
        out["group_index"].append(np.full(n, gi, dtype=np.int64))
    return {k: np.concatenate(v) for k, v in out.items()}


def attach_advantages(batch: dict[str, np.ndarray], mode: str, eps: float) -> dict[str, np.ndarray]:
    """Per-token advantages: each sample's group-normalised advantage on its loss tokens, 0 elsewhere."""
    adv = group_advantages(torch.from_numpy(batch["rewards"]), torch.from_numpy(batch["group_index"]), mode, eps).numpy()
    out = dict(batch)
    out["sample_advantages"] = adv.astype(np.float32)
    out["advantages"] = (adv[:, None] * (batch["loss_mask"] != 0)).astype(np.float32)
    return out


def shard(batch: dict[str, np.ndarray], world_size: int, n_minibatches: int) -> list[list[dict[str, Any]]]:
    """`result[rank][i]` is rank's piece of mini-batch i. Samples are split as evenly as possible;
    every rank gets a piece of every mini-batch (ZeRO-3 needs the same number of forward passes on
    every rank), each piece carrying the mini-batch's global token and sequence counts."""
    n = batch["input_ids"].shape[0]
    if n < world_size * n_minibatches:
        raise ValueError(
            f"a step of {n} samples cannot give {world_size} ranks x {n_minibatches} mini-batches a sample each: "
            "raise batch_groups or lower ppo.n_minibatches"
        )
    minibatch_idx = np.array_split(np.arange(n), n_minibatches)
    out: list[list[dict[str, Any]]] = [[] for _ in range(world_size)]
    for mb in minibatch_idx:
        tokens = float((batch["loss_mask"][mb] != 0).sum())
        seqs = float(((batch["loss_mask"][mb] != 0).sum(-1) > 0).sum())
        for rank, idx in enumerate(np.array_split(mb, world_size)):
            length = int(batch["attention_mask"][idx].sum(-1).max())  # trim shared padding
            piece: dict[str, Any] = {
                k: batch[k][idx][:, :length] for k in (*TOKEN_KEYS, "advantages") if k in batch
            }
            piece["total_tokens"] = tokens
            piece["total_seqs"] = seqs
            out[rank].append(piece)
    return out


def to_tensors(piece: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v for k, v in piece.items()}
