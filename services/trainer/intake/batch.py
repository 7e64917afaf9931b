"""From decoded groups to what each rank trains on: collate the groups of a step into one padded
batch, and cut the batch into each rank's mini-batch pieces with the global counts the loss divides by.

Extra columns a workflow returned (per-sample (n,) or per-token (n, length) arrays beside the contract's)
travel with their samples into every piece, for the algorithm (`extra_columns`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from services.common.logging import get_logger
from services.trainer.intake.columns import RESERVED_KEYS, TOKEN_KEYS, extra_columns

log = get_logger("trainer.batch")



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
    batch = {k: np.concatenate(v) for k, v in out.items()}
    batch.update(_collate_extras(groups, seqlen))
    return batch


def _collate_extras(groups: list[dict[str, np.ndarray]], seqlen: int) -> dict[str, np.ndarray]:
    """Extra columns present in every group of the step, per-sample concatenated, per-token padded
    with 0. One that is not (or shadows a trainer name) is left out, with a warning naming it."""
    out: dict[str, np.ndarray] = {}
    names = sorted({k for g in groups for k in g} - set(TOKEN_KEYS) - {"rewards"})
    for name in names:
        arrays = [g.get(name) for g in groups]
        why = ""
        if name in RESERVED_KEYS:
            why = "the name is reserved by the trainer"
        elif any(a is None for a in arrays):
            why = "missing from some groups of the step"
        elif not all(a is not None and (a.shape == (g["input_ids"].shape[0],) or a.shape == g["input_ids"].shape)
                     for a, g in zip(arrays, groups, strict=True)):
            why = "not shaped (samples,) or (samples, tokens) like input_ids"
        elif len({a.ndim for a in arrays if a is not None}) != 1:
            why = "per-sample in some groups, per-token in others"
        if why:
            log.warning("extra trajectory column left out of the step", column=name, reason=why)
            continue
        if arrays[0] is not None and arrays[0].ndim == 1:
            out[name] = np.concatenate([a for a in arrays if a is not None])
            continue
        padded = []
        for a in arrays:
            assert a is not None
            p = np.zeros((a.shape[0], seqlen), dtype=a.dtype)
            p[:, : a.shape[1]] = a
            padded.append(p)
        out[name] = np.concatenate(padded)
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
            for k in extra_columns(batch):
                piece[k] = batch[k][idx][:, :length] if batch[k].ndim == 2 else batch[k][idx]
            piece["total_tokens"] = tokens
            piece["total_seqs"] = seqs
            out[rank].append(piece)
    return out
