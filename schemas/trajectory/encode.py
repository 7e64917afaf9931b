"""Encoding: a padded tensor dict (numpy or torch, duck-typed; torch is never imported) -> one Arrow
IPC message. Values are checked to fit the contract's column types; nothing loops over tokens in
Python: rows are copied as slices.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.trajectory.contract import (
    REQUIRED_KEYS,
    RESERVED_ARROW_NAMES,
    SCHEMA_TEXT,
    TOKEN_COLUMNS,
    TrajectoryError,
    TrajectoryMeta,
    pooled_flat,
)

_NUMPY_TYPES = {col: np.dtype(arrow_type.to_pandas_dtype()) for col, arrow_type in TOKEN_COLUMNS.values()}
_INT32, _FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)
_INT32_MAX = int(np.iinfo(np.int32).max)


# ------------------------------------------------------------------------------------------- helpers


def _as_numpy(name: str, value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        if str(value.dtype) == "torch.bfloat16":
            raise TrajectoryError(f"{name}: bfloat16 has no lossless Arrow type; cast to float32 first")
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.dtype == object:
        raise TrajectoryError(f"{name}: not a numeric array (got an object array; ragged rows?)")
    return arr


def _check_kind(name: str, arr: np.ndarray, kinds: str, what: str) -> None:
    if arr.dtype.kind not in kinds:
        raise TrajectoryError(f"{name}: dtype {arr.dtype} is not {what}")


_INT_LIMITS: dict[np.dtype, tuple[int, int]] = {}
_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _check_castable(name: str, arr: np.ndarray, target: np.dtype) -> None:
    """Refuse any cast to the Arrow column's type that would change a value."""
    source = arr.dtype
    if source == target:
        return
    if source.kind in "iub" and target.kind == "i":
        if source.kind == "b" or source.itemsize < target.itemsize:
            return  # every value fits: no pass over the data
        limits = _INT_LIMITS.get(target)
        if limits is None:
            info = np.iinfo(target)
            limits = _INT_LIMITS[target] = (int(info.min), int(info.max))
        if arr.size:
            lo, hi = arr.min(), arr.max()
            if lo < limits[0] or hi > limits[1]:
                raise TrajectoryError(f"{name}: values out of {target} range [{lo}, {hi}]")
        return
    if source.kind == "f" and target.kind == "f":
        if source.itemsize > target.itemsize:
            raise TrajectoryError(f"{name}: {source} would lose precision as {target}; cast it first")
        return
    raise TrajectoryError(f"{name}: cannot store {source} as {target}")


def _ragged(arr2d: np.ndarray, bounds: list[int], offsets: pa.Array, arrow_type: pa.DataType, target: np.dtype) -> pa.Array:
    """Concatenate each row's first tokens (row i is flat[bounds[i]:bounds[i + 1]]), cast on the fly:
    one cast of the whole buffer when no row is padded, else one concatenation of the row slices."""
    if bounds[-1] == arr2d.size:
        flat = arr2d.reshape(-1).astype(target, copy=False)
    else:
        flat = pooled_flat(bounds[-1], target)
        rows = [arr2d[i, : bounds[i + 1] - bounds[i]] for i in range(arr2d.shape[0])]
        np.concatenate(rows, out=flat, casting="unsafe")  # the values were checked to fit
    return pa.ListArray.from_arrays(offsets, pa.array(flat, type=arrow_type))


# ------------------------------------------------------------------------------------------- encode


def encode_group(
    tensors: Mapping[str, Any],
    *,
    run: str,
    prompt_id: str,
    worker: str,
    is_eval: bool = False,
    workflow: str = "",
) -> bytes:
    """Encode a padded tensor dict (one group) as one Arrow IPC stream message."""
    return encode_group_with_meta(tensors, run=run, prompt_id=prompt_id, worker=worker, is_eval=is_eval, workflow=workflow)[0]


def encode_group_with_meta(
    tensors: Mapping[str, Any],
    *,
    run: str,
    prompt_id: str,
    worker: str,
    is_eval: bool = False,
    workflow: str = "",
) -> tuple[bytes, TrajectoryMeta]:
    """`encode_group`, also returning the metadata (for the message headers)."""
    batch, meta = group_to_batch(tensors, run=run, prompt_id=prompt_id, worker=worker, is_eval=is_eval, workflow=workflow)
    return batch_to_bytes(batch), meta


_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def batch_to_bytes(batch: pa.RecordBatch) -> bytes:
    """One record batch -> the bytes of an Arrow IPC stream holding it. The stream format is the schema
    message, the batch messages, then an end-of-stream marker: the same bytes as pa.ipc.new_stream's
    writer gives, at half its fixed cost. (No dictionary columns here, which the writer would also
    have to emit.)"""
    return b"".join((batch.schema.serialize(), batch.serialize(), _END_OF_STREAM))


def encode_table(table: pa.Table) -> bytes:
    """A group's Arrow table (as `group_to_table` builds it) -> the bytes of one trajectory message."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def group_to_table(
    tensors: Mapping[str, Any],
    *,
    run: str,
    prompt_id: str,
    worker: str,
    is_eval: bool = False,
    workflow: str = "",
) -> tuple[pa.Table, TrajectoryMeta]:
    """A padded tensor dict (one group) -> its Arrow table (one row per sample) and metadata."""
    batch, meta = group_to_batch(tensors, run=run, prompt_id=prompt_id, worker=worker, is_eval=is_eval, workflow=workflow)
    return pa.Table.from_batches([batch]), meta


def group_to_batch(
    tensors: Mapping[str, Any],
    *,
    run: str,
    prompt_id: str,
    worker: str,
    is_eval: bool = False,
    workflow: str = "",
) -> tuple[pa.RecordBatch, TrajectoryMeta]:
    """`group_to_table`, as the one record batch a trajectory message carries."""
    missing = [k for k in REQUIRED_KEYS if k not in tensors]
    if missing:
        raise TrajectoryError(f"missing required keys: {', '.join(missing)}")
    arrays = {k: _as_numpy(k, v) for k, v in tensors.items()}

    mask = arrays["attention_mask"]
    if mask.ndim != 2:
        raise TrajectoryError(f"attention_mask: expected shape (batch, seqlen), got {mask.shape}")
    _check_kind("attention_mask", mask, "biuf", "numeric or bool")
    batch, seqlen = mask.shape
    lengths = _row_lengths(mask)
    offsets = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > _INT32_MAX:
        raise TrajectoryError("attention_mask: more than 2^31 tokens in one group")
    bounds: list[int] = offsets.tolist()
    pa_offsets = pa.array(offsets.astype(np.int32))

    dtypes: dict[str, str] = {"attention_mask": _dtype_name(mask.dtype)}
    columns: dict[str, pa.Array] = {}
    for key, (col, arrow_type) in TOKEN_COLUMNS.items():
        arr = arrays[key]
        if arr.shape != (batch, seqlen):
            raise TrajectoryError(f"{key}: shape {arr.shape} does not match attention_mask {(batch, seqlen)}")
        _check_kind(key, arr, "f" if key == "logprobs" else "iub", "float" if key == "logprobs" else "integer")
        dtypes[key] = _dtype_name(arr.dtype)
        target = _NUMPY_TYPES[col]
        _check_castable(key, arr, target)
        columns[col] = _ragged(arr, bounds, pa_offsets, arrow_type, target)

    rewards = arrays["rewards"]
    if rewards.shape != (batch,):
        raise TrajectoryError(f"rewards: expected shape ({batch},), got {rewards.shape}")
    _check_kind("rewards", rewards, "fiub", "numeric")
    dtypes["rewards"] = _dtype_name(rewards.dtype)
    _check_castable("rewards", rewards, _FLOAT32)
    columns["reward"] = pa.array(rewards.astype(np.float32, copy=False), type=pa.float32())

    if "prompt_len" in arrays:
        prompt_len = arrays["prompt_len"]
        if prompt_len.shape != (batch,):
            raise TrajectoryError(f"prompt_len: expected shape ({batch},), got {prompt_len.shape}")
        dtypes["prompt_len"] = _dtype_name(prompt_len.dtype)
    else:  # the first token the loss sees starts the completion
        active = arrays["loss_mask"] != 0
        prompt_len = np.where(active.any(axis=1), active.argmax(axis=1), lengths)
    _check_castable("prompt_len", prompt_len, _INT32)
    columns["prompt_len"] = pa.array(prompt_len.astype(np.int32, copy=False), type=pa.int32())

    for key, arr in arrays.items():
        if key in REQUIRED_KEYS or key == "prompt_len":
            continue
        if key in RESERVED_ARROW_NAMES:
            raise TrajectoryError(f"{key}: extra key collides with a contract column name")
        _check_kind(key, arr, "biuf", "numeric or bool")
        dtypes[key] = _dtype_name(arr.dtype)
        if arr.shape == (batch,):
            columns[key] = pa.array(arr)
        elif arr.shape == (batch, seqlen):
            columns[key] = _ragged(arr, bounds, pa_offsets, pa.from_numpy_dtype(arr.dtype), arr.dtype)
        else:
            raise TrajectoryError(
                f"{key}: extra keys must be per-sample ({batch},) or per-token {(batch, seqlen)}, got {arr.shape}"
            )

    head, tail = _version_span(columns["versions"].values.to_numpy(), columns["loss_mask"].values.to_numpy())
    meta = TrajectoryMeta(
        run=run, prompt_id=prompt_id, worker=worker, head_version=head, tail_version=tail, is_eval=is_eval, workflow=workflow
    )
    metadata = {
        "jetrl.schema": SCHEMA_TEXT,
        "run": run,
        "prompt_id": prompt_id,
        "worker": worker,
        "head_version": str(head),
        "tail_version": str(tail),
        "is_eval": "1" if is_eval else "0",
        "jetrl.dtypes": json.dumps(dtypes),
        "jetrl.seqlen": str(seqlen),
    }
    if workflow:
        metadata["workflow"] = workflow
    return pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns), metadata=metadata), meta


def _row_lengths(mask: np.ndarray) -> np.ndarray:
    """Tokens per row of a right-padded attention mask (ones then zeros), refusing any other shape."""
    if mask.all():  # every row full (the common case for fixed-length groups): one pass
        return np.full(mask.shape[0], mask.shape[1], dtype=np.int64)
    mask_bool = mask if mask.dtype == np.bool_ else mask != 0
    lengths = mask_bool.sum(axis=1)
    if not np.array_equal(mask_bool, np.arange(mask.shape[1]) < lengths[:, None]):
        raise TrajectoryError("attention_mask: must be right-padded (ones then zeros in every row)")
    return lengths


def _version_span(versions: np.ndarray, loss_mask: np.ndarray) -> tuple[int, int]:
    """(oldest, newest) weight version among the trained tokens (loss_mask != 0); (-1, -1) if none is
    trained. Staleness is about the tokens the loss sees: what a prompt or feedback token is tagged
    with (-1 here, 0 in AReaL's examples) does not count. A trained token without a version (< 0)
    would make the group look infinitely stale, so it is refused here, by name."""
    trained = versions[loss_mask != 0]
    if not trained.size:
        return -1, -1
    head, tail = int(trained.min()), int(trained.max())
    if head < 0:
        missing = int((trained < 0).sum())
        raise TrajectoryError(
            f"versions: {missing} trained tokens (loss_mask != 0) have no weight version ({head}); every "
            "generated token needs the version of the weights that produced it (ModelResponse.output_versions)"
        )
    return head, tail
