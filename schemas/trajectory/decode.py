"""Decoding: one Arrow IPC message -> the padded numpy tensor dict (original dtypes) and its metadata.
Any malformed message raises `TrajectoryError` naming what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.trajectory.contract import (
    RESERVED_ARROW_NAMES,
    SAMPLE_COLUMNS,
    SUPPORTED_SCHEMA_VERSIONS,
    TOKEN_COLUMNS,
    DecodedGroup,
    TrajectoryError,
    TrajectoryMeta,
    pooled,
)


def decode_group(data: bytes | memoryview | pa.Buffer, *, max_seq_len: int | None = None) -> DecodedGroup:
    """Decode one trajectory message into a padded numpy tensor dict and its metadata. `max_seq_len`:
    refuse (`too_long`, `length_mismatch`) rows or a padded width longer than this, before allocating."""
    try:
        reader = pa.ipc.open_stream(data if isinstance(data, pa.Buffer) else pa.py_buffer(data))
        batches = list(reader)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise TrajectoryError(f"not a complete Arrow IPC stream (truncated or corrupt): {exc}") from exc
    if len(batches) == 1:  # as the codec writes a group: its columns are plain arrays, not chunked
        table = pa.Table.from_batches(batches)
        columns: pa.Table | pa.RecordBatch = batches[0]
    else:  # written by another tool in several batches (or none)
        table = columns = pa.Table.from_batches(batches, schema=reader.schema).combine_chunks()
    meta: TrajectoryMeta | None = None
    try:
        md = _metadata(table)
        meta = _meta_from(md)
        return DecodedGroup(tensors=table_to_padded(columns, md, max_seq_len=max_seq_len), meta=meta, table=table)
    except TrajectoryError as exc:
        exc.meta = meta
        raise
    except Exception as exc:  # any other way a message can be malformed is still a malformed message
        err = TrajectoryError(f"malformed trajectory message ({type(exc).__name__}: {exc})")
        err.meta = meta
        raise err from exc


def _metadata(table: pa.Table | pa.RecordBatch) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}


def table_meta(table: pa.Table) -> TrajectoryMeta:
    return _meta_from(_metadata(table))


def _meta_from(md: dict[str, str]) -> TrajectoryMeta:
    version = md.get("jetrl.schema")
    if version is None or not version.isdigit() or int(version) not in SUPPORTED_SCHEMA_VERSIONS:
        raise TrajectoryError(
            f"jetrl.schema: unsupported trajectory schema version {version!r} "
            f"(this build reads {sorted(SUPPORTED_SCHEMA_VERSIONS)})"
        )
    try:
        return TrajectoryMeta(
            run=md["run"],
            prompt_id=md["prompt_id"],
            worker=md.get("worker", ""),
            head_version=int(md["head_version"]),
            tail_version=int(md["tail_version"]),
            is_eval=md.get("is_eval") == "1",
            workflow=md.get("workflow", ""),
        )
    except (KeyError, ValueError) as exc:
        raise TrajectoryError(f"schema metadata: missing or bad field {exc}") from exc


_LIST_TYPES = {col: pa.list_(arrow_type) for col, arrow_type in TOKEN_COLUMNS.values()}


def _list_parts(name: str, column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (from 0) and values of a list column, as numpy views of the Arrow buffers."""
    arr = column
    if isinstance(column, pa.ChunkedArray):
        arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if not pa.types.is_list(arr.type):
        raise TrajectoryError(f"{name}: expected a list column, got {arr.type}")
    if arr.null_count:
        raise TrajectoryError(f"{name}: has null rows")
    bufs = arr.buffers()  # [validity, offsets, child validity, child values]
    offsets = np.frombuffer(bufs[1], dtype=np.int32, count=len(arr) + 1, offset=arr.offset * 4)
    child = arr.values
    if child.null_count or child.type.bit_width % 8:
        values = child.to_numpy(zero_copy_only=False)
    else:
        item = child.type.bit_width // 8
        values = np.frombuffer(bufs[3], dtype=child.type.to_pandas_dtype(), count=len(child), offset=child.offset * item)
    start, end = int(offsets[0]), int(offsets[-1])
    # Offsets come from the sender: decreasing ones or ones past the values would make rows of
    # any (negative, huge) length out of a few bytes.
    if len(offsets) > 1 and (bool((np.diff(offsets) < 0).any()) or start < 0 or end > len(values)):
        raise TrajectoryError(f"{name}: list offsets are not within its {len(values)} values", "length_mismatch")
    return offsets - start, values[start:end]


def _dtypes_from(text: str) -> dict[str, str]:
    """The `jetrl.dtypes` metadata: tensor name -> numpy dtype name, each checked."""
    try:
        dtypes = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TrajectoryError(f"jetrl.dtypes: not JSON: {exc}") from exc
    if not isinstance(dtypes, dict):
        raise TrajectoryError(f"jetrl.dtypes: expected an object of name -> dtype, got {type(dtypes).__name__}")
    for name, dtype in dtypes.items():
        try:
            ok = isinstance(dtype, str) and np.dtype(dtype).kind in "biuf"
        except TypeError:
            ok = False
        if not ok:
            raise TrajectoryError(f"jetrl.dtypes: {name}: not a numeric dtype: {dtype!r}")
    return dtypes


def table_to_padded(table: pa.Table | pa.RecordBatch, metadata: dict[str, str] | None = None, *,
                    max_seq_len: int | None = None) -> dict[str, np.ndarray]:
    """Arrow table (or record batch) of one group, or of many samples -> padded numpy dict with the
    original dtypes. `metadata`: the table's schema metadata when the caller has already read it.
    `max_seq_len`: the longest row, and padded width, accepted (None: no limit)."""
    md = _metadata(table) if metadata is None else metadata
    dtypes = _dtypes_from(md.get("jetrl.dtypes", "{}"))
    schema = table.schema
    names = set(schema.names)
    for col, list_type in _LIST_TYPES.items():
        if col not in names:
            raise TrajectoryError(f"{col}: required column missing")
        if schema.field(col).type != list_type:
            raise TrajectoryError(f"{col}: expected {list_type}, got {schema.field(col).type}")
    for col, _ in SAMPLE_COLUMNS.values():
        if col not in names:
            raise TrajectoryError(f"{col}: required column missing")

    batch = table.num_rows
    ref_offsets, _ = _list_parts("input_ids", table.column("input_ids"))
    lengths = np.diff(ref_offsets)
    seqlen_text = md.get("jetrl.seqlen", "0")
    if not seqlen_text.isdigit():
        raise TrajectoryError(f"jetrl.seqlen: not a length: {seqlen_text!r}")
    longest = int(lengths.max()) if batch else 0
    declared = int(seqlen_text)
    # Every check before the first allocation: the padded arrays are sized from these numbers.
    if "jetrl.seqlen" in md and declared < longest:
        raise TrajectoryError(f"jetrl.seqlen: {declared} is shorter than the longest row ({longest} tokens)", "length_mismatch")
    if max_seq_len is not None and longest > max_seq_len:
        raise TrajectoryError(f"input_ids: a row of {longest} tokens is longer than max_seq_len {max_seq_len}", "too_long")
    if max_seq_len is not None and declared > max_seq_len:
        raise TrajectoryError(
            f"jetrl.seqlen: claims {declared} tokens per row, more than max_seq_len {max_seq_len} "
            f"(its longest row has {longest})", "length_mismatch",
        )
    seqlen = max(declared, longest)
    full_rows = batch > 0 and bool((lengths == seqlen).all())
    bounds = ref_offsets.tolist()
    ref_bytes = ref_offsets.tobytes()

    def pad(name: str, offsets: np.ndarray, values: np.ndarray, dtype: np.dtype) -> np.ndarray:
        if offsets is not ref_offsets and offsets.tobytes() != ref_bytes:  # (B + 1 numbers: cheaper than array_equal)
            raise TrajectoryError(f"{name}: row lengths differ from input_ids (ragged mismatch)")
        out = pooled((batch, seqlen), dtype)
        if full_rows:  # no padding: one cast of the whole buffer
            np.copyto(out, values.reshape(batch, seqlen), casting="unsafe")
            return out
        out.fill(0)
        for i in range(batch):
            out[i, : bounds[i + 1] - bounds[i]] = values[bounds[i] : bounds[i + 1]]
        return out

    out: dict[str, np.ndarray] = {}
    for key, (col, _) in TOKEN_COLUMNS.items():
        offsets, values = _list_parts(col, table.column(col))
        out[key] = pad(col, offsets, values, np.dtype(dtypes.get(key, values.dtype)))
    mask = out["attention_mask"] = pooled((batch, seqlen), np.dtype(dtypes.get("attention_mask", "int64")))
    mask.fill(1 if full_rows else 0)
    if not full_rows:
        for i in range(batch):
            mask[i, : bounds[i + 1] - bounds[i]] = 1
    out["rewards"] = table.column("reward").to_numpy().astype(dtypes.get("rewards", "float32"))
    if "prompt_len" in dtypes:
        out["prompt_len"] = table.column("prompt_len").to_numpy().astype(dtypes["prompt_len"])
    for col in schema.names:
        if col in RESERVED_ARROW_NAMES or col not in dtypes:
            continue  # columns added outside the codec (e.g. export metadata) are not tensors
        column = table.column(col)
        if pa.types.is_list(column.type):
            offsets, values = _list_parts(col, column)
            out[col] = pad(col, offsets, values, np.dtype(dtypes[col]))
        else:
            out[col] = column.to_numpy().astype(dtypes[col])
    return out


def to_torch(tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Numpy dict -> torch tensors (shares memory); imports torch lazily."""
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}
