"""The Arrow trajectory codec: a padded tensor dict <-> one Arrow IPC message with ragged columns.

One message holds one group (one row per sample). Token columns are `list<...>` columns whose offsets
come from the attention mask; every per-token column of a message shares the same offsets. Padding is
not stored: it decodes as 0. Original dtypes are kept in the schema metadata so a round trip gives the
same arrays, dtype included. Nothing here loops over tokens in Python: rows are copied as slices.

Inputs may be numpy arrays or torch tensors (duck-typed; torch is never imported here). Decoding
gives numpy arrays; `to_torch` converts them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

TRAJECTORY_SCHEMA_VERSION = 1
_SCHEMA_TEXT = str(TRAJECTORY_SCHEMA_VERSION)
SUPPORTED_SCHEMA_VERSIONS = frozenset({TRAJECTORY_SCHEMA_VERSION})

#: per-token columns of the contract: padded name -> (Arrow column name, Arrow value type)
TOKEN_COLUMNS: dict[str, tuple[str, pa.DataType]] = {
    "input_ids": ("input_ids", pa.int32()),
    "loss_mask": ("loss_mask", pa.int8()),
    "logprobs": ("logprobs", pa.float32()),
    "versions": ("versions", pa.int32()),
}
#: per-sample columns of the contract
SAMPLE_COLUMNS: dict[str, tuple[str, pa.DataType]] = {
    "rewards": ("reward", pa.float32()),
    "prompt_len": ("prompt_len", pa.int32()),
}
_NUMPY_TYPES = {col: np.dtype(arrow_type.to_pandas_dtype()) for col, arrow_type in TOKEN_COLUMNS.values()}
_INT32, _FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)
_INT32_MAX = int(np.iinfo(np.int32).max)
REQUIRED_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "rewards", "versions")
_RESERVED_ARROW_NAMES = {name for name, _ in (*TOKEN_COLUMNS.values(), *SAMPLE_COLUMNS.values())}


class TrajectoryError(ValueError):
    """A tensor dict or an Arrow message that breaks the trajectory contract; the text names the field."""


@dataclass(frozen=True)
class TrajectoryMeta:
    """The schema metadata of one trajectory message."""

    run: str
    prompt_id: str
    worker: str
    head_version: int
    """Oldest weight version that produced a token of the group (-1 if no token was generated)."""
    tail_version: int
    is_eval: bool = False


@dataclass(frozen=True)
class DecodedGroup:
    tensors: dict[str, np.ndarray]
    meta: TrajectoryMeta
    table: pa.Table


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
        flat = _pooled_flat(bounds[-1], target)
        rows = [arr2d[i, : bounds[i + 1] - bounds[i]] for i in range(arr2d.shape[0])]
        np.concatenate(rows, out=flat, casting="unsafe")  # the values were checked to fit
    return pa.ListArray.from_arrays(offsets, pa.array(flat, type=arrow_type))


def _pooled_flat(size: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialised 1-d array in Arrow's memory pool, which keeps freed blocks for reuse: coding
    one group after another then writes to warm memory instead of faulting in fresh pages from the
    C allocator at every call (which on a VM costs more than the coding itself)."""
    return np.frombuffer(pa.allocate_buffer(size * dtype.itemsize), dtype=dtype)


def _pooled(shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """`_pooled_flat` in a padded 2-d shape."""
    return _pooled_flat(shape[0] * shape[1], dtype).reshape(shape)


# ------------------------------------------------------------------------------------------- encode


def encode_group(
    tensors: Mapping[str, Any],
    *,
    run: str,
    prompt_id: str,
    worker: str,
    is_eval: bool = False,
) -> bytes:
    """Encode a padded tensor dict (one group) as one Arrow IPC stream message."""
    return encode_group_with_meta(tensors, run=run, prompt_id=prompt_id, worker=worker, is_eval=is_eval)[0]


def encode_group_with_meta(
    tensors: Mapping[str, Any],
    *,
    run: str,
    prompt_id: str,
    worker: str,
    is_eval: bool = False,
) -> tuple[bytes, TrajectoryMeta]:
    """`encode_group`, also returning the metadata (for the message headers)."""
    batch, meta = group_to_batch(tensors, run=run, prompt_id=prompt_id, worker=worker, is_eval=is_eval)
    # The IPC stream format is the schema message, the batch messages, then an end-of-stream marker:
    # the same bytes as pa.ipc.new_stream's writer gives, at half its fixed cost. (No dictionary
    # columns here, which the writer would also have to emit.)
    return b"".join((batch.schema.serialize(), batch.serialize(), _END_OF_STREAM)), meta


_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


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
) -> tuple[pa.Table, TrajectoryMeta]:
    """A padded tensor dict (one group) -> its Arrow table (one row per sample) and metadata."""
    batch, meta = group_to_batch(tensors, run=run, prompt_id=prompt_id, worker=worker, is_eval=is_eval)
    return pa.Table.from_batches([batch]), meta


def group_to_batch(
    tensors: Mapping[str, Any],
    *,
    run: str,
    prompt_id: str,
    worker: str,
    is_eval: bool = False,
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
        if key in _RESERVED_ARROW_NAMES:
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

    head, tail = _version_span(columns["versions"].values.to_numpy())
    meta = TrajectoryMeta(run=run, prompt_id=prompt_id, worker=worker, head_version=head, tail_version=tail, is_eval=is_eval)
    metadata = {
        "jetrl.schema": _SCHEMA_TEXT,
        "run": run,
        "prompt_id": prompt_id,
        "worker": worker,
        "head_version": str(head),
        "tail_version": str(tail),
        "is_eval": "1" if is_eval else "0",
        "jetrl.dtypes": json.dumps(dtypes),
        "jetrl.seqlen": str(seqlen),
    }
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


def _version_span(versions: np.ndarray) -> tuple[int, int]:
    """(oldest, newest) weight version among generated tokens (>= 0); (-1, -1) if there are none.
    Seen as unsigned, the prompt tokens' negative versions sort after every real one: one pass each."""
    if not versions.size:
        return -1, -1
    tail = int(versions.max())
    if tail < 0:
        return -1, -1
    return int(versions.view(np.uint32).min()), tail


# ------------------------------------------------------------------------------------------- decode


def decode_group(data: bytes | memoryview | pa.Buffer) -> DecodedGroup:
    """Decode one trajectory message into a padded numpy tensor dict and its metadata."""
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
    try:
        md = _metadata(table)
        return DecodedGroup(tensors=table_to_padded(columns, md), meta=_meta_from(md), table=table)
    except TrajectoryError:
        raise
    except Exception as exc:  # any other way a message can be malformed is still a malformed message
        raise TrajectoryError(f"malformed trajectory message ({type(exc).__name__}: {exc})") from exc


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
    start = int(offsets[0])
    return offsets - start, values[start : int(offsets[-1])]


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


def table_to_padded(table: pa.Table | pa.RecordBatch, metadata: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Arrow table (or record batch) of one group, or of many samples -> padded numpy dict with the
    original dtypes. `metadata`: the table's schema metadata when the caller has already read it."""
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
    seqlen = max(int(seqlen_text), int(lengths.max()) if batch else 0)
    full_rows = batch > 0 and bool((lengths == seqlen).all())
    bounds = ref_offsets.tolist()
    ref_bytes = ref_offsets.tobytes()

    def pad(name: str, offsets: np.ndarray, values: np.ndarray, dtype: np.dtype) -> np.ndarray:
        if offsets is not ref_offsets and offsets.tobytes() != ref_bytes:  # (B + 1 numbers: cheaper than array_equal)
            raise TrajectoryError(f"{name}: row lengths differ from input_ids (ragged mismatch)")
        out = _pooled((batch, seqlen), dtype)
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
    mask = out["attention_mask"] = _pooled((batch, seqlen), np.dtype(dtypes.get("attention_mask", "int64")))
    mask.fill(1 if full_rows else 0)
    if not full_rows:
        for i in range(batch):
            mask[i, : bounds[i + 1] - bounds[i]] = 1
    out["rewards"] = table.column("reward").to_numpy().astype(dtypes.get("rewards", "float32"))
    if "prompt_len" in dtypes:
        out["prompt_len"] = table.column("prompt_len").to_numpy().astype(dtypes["prompt_len"])
    for col in schema.names:
        if col in _RESERVED_ARROW_NAMES or col not in dtypes:
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
