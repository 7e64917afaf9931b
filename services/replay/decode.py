"""Replay's decoding: a pull's worth of trajectory messages at once, each to exactly `decode_group`'s result.

Replay decodes every group it reads on the event loop. For groups of a few thousand tokens the codec's
time is mostly fixed cost per call: Python, Arrow and numpy steps on small arrays, each of them cold
again by the time the next message comes. `decode_groups` does each step for all messages of a pull
before the next step (read, check, metadata, then one column after another), so the same code runs
many times in a row; the metadata is parsed once, the row mask built once per group and each column
padded with one masked assignment. About 3x faster than one `decode_group` after another.

Only messages of exactly the codec's own layout go this way: one record batch, the contract's columns
and types, no nulls, metadata as the codec writes it. Any other message (extra workflow columns,
another writer, a corrupt one) goes to `decode_group` itself, so it decodes, or fails with the same
error, as it does in the codec.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.headers import is_rejection
from schemas.trajectory import (
    SAMPLE_COLUMNS,
    SUPPORTED_SCHEMA_VERSIONS,
    TOKEN_COLUMNS,
    DecodedGroup,
    TrajectoryMeta,
    decode_group,
)
from services.replay.reader import Record

#: the layout `group_to_table` writes for a group without extra columns
_LAYOUT = pa.schema([
    *((col, pa.list_(arrow_type)) for col, arrow_type in TOKEN_COLUMNS.values()),
    *SAMPLE_COLUMNS.values(),
])
# A record batch as a struct array lists its buffers depth first: the struct's validity, then per
# list column [validity, offsets, values' validity, values], per sample column [validity, values].
# With no nulls every validity buffer (index 0 and every odd index) is absent.
_OFFSETS = [1 + 4 * i + 1 for i in range(len(TOKEN_COLUMNS))]
_VALUES = [1 + 4 * i + 3 for i in range(len(TOKEN_COLUMNS))]
_REWARD, _PROMPT_LEN = (1 + 4 * len(TOKEN_COLUMNS) + 2 * i + 1 for i in range(2))
_WIRE = [np.dtype(arrow_type.to_pandas_dtype()) for _, arrow_type in TOKEN_COLUMNS.values()]
_VALUE_SIZES = [(at, wire.itemsize) for at, wire in zip(_VALUES, _WIRE, strict=True)]
_INT64, _FLOAT32, _INT32 = np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.int32)


#: groups decoded together: enough for the steps to run hot, few enough that long groups do not
#: pile up in memory ahead of the trainer (16 groups of 8 x 4k tokens: ~20 MB)
AHEAD = 16


async def decode_ahead(batches: AsyncGenerator[list[Record], None]) -> AsyncIterator[Record]:
    """The records of each batch in order, each group decoded (`Record.decoded`); markers are left as they are."""
    async with contextlib.aclosing(batches):
        async for batch in batches:
            for start in range(0, len(batch), AHEAD):
                records = batch[start : start + AHEAD]
                todo = [i for i, record in enumerate(records) if not is_rejection(record.headers)]
                for i, decoded in zip(todo, decode_groups([records[i].data for i in todo]), strict=True):
                    records[i] = records[i].with_decoded(decoded)
                for record in records:
                    yield record


def decode_groups(datas: Sequence[bytes]) -> list[DecodedGroup | Exception]:
    """`decode_group` of each message: its group, or the exception it raised."""
    plain = [_layout(batch) for batch in [_read(data) for data in datas]]
    plain = [p if p is not None and _describe(p) else None for p in plain]
    ready = [p for p in plain if p is not None]
    for key, at, wire in zip(TOKEN_COLUMNS, _VALUES, _WIRE, strict=True):
        for p in ready:
            values = np.frombuffer(p.buffers[at], dtype=wire, count=p.total)
            dtype = p.dtypes.get(key, wire)
            if p.mask is None:  # no padding: one cast of the whole buffer
                p.tensors[key] = values.reshape(p.rows, p.seqlen).astype(dtype)
            else:  # the mask's row-major order is the values' ragged order
                p.tensors[key] = out = np.zeros((p.rows, p.seqlen), dtype=dtype)
                out[p.mask] = values
    for p in ready:
        mask_dtype = p.dtypes.get("attention_mask", _INT64)
        p.tensors["attention_mask"] = np.ones((p.rows, p.seqlen), mask_dtype) if p.mask is None else p.mask.astype(mask_dtype)
    for p in ready:
        rewards = np.frombuffer(p.buffers[_REWARD], dtype=_FLOAT32, count=p.rows)
        p.tensors["rewards"] = rewards.astype(p.dtypes.get("rewards", _FLOAT32))
        if "prompt_len" in p.dtypes:
            prompt_len = np.frombuffer(p.buffers[_PROMPT_LEN], dtype=_INT32, count=p.rows)
            p.tensors["prompt_len"] = prompt_len.astype(p.dtypes["prompt_len"])
    return [p.group() if p is not None else _decode_or_error(data) for data, p in zip(datas, plain, strict=True)]


@dataclass
class _Plain:
    """One message of the codec's own layout, filled in step by step."""

    batch: pa.RecordBatch
    buffers: list[Any]
    """The batch's buffers, depth first (see `_OFFSETS`): pa.Buffer, or None for an absent validity
    buffer (`_layout` has checked that every offsets and values buffer is there)."""
    rows: int
    meta: TrajectoryMeta | None = None
    dtypes: dict[str, np.dtype] = field(default_factory=dict)
    seqlen: int = 0
    total: int = 0
    mask: np.ndarray | None = None
    """Which padded positions hold tokens; None when every row is full."""
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    def group(self) -> DecodedGroup:
        assert self.meta is not None
        return DecodedGroup(tensors=self.tensors, meta=self.meta, table=pa.Table.from_batches([self.batch]))


def _decode_or_error(data: bytes) -> DecodedGroup | Exception:
    try:
        return decode_group(data)
    except Exception as exc:  # handed to whoever judges the message, who raises it as decode_group would
        return exc


def _read(data: bytes) -> pa.RecordBatch | None:
    """The message's only record batch; None for anything else (the codec will say what is wrong)."""
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        batch = reader.read_next_batch()
    except (pa.ArrowException, OSError, StopIteration):
        return None
    try:
        reader.read_next_batch()
    except StopIteration:
        return batch
    except (pa.ArrowException, OSError):
        return None
    return None  # several batches: not as the codec writes a group


def _layout(batch: pa.RecordBatch | None) -> _Plain | None:
    """The codec's own layout: contract columns and types, no nulls, all token columns split into the same rows."""
    if batch is None or batch.num_rows == 0 or not batch.schema.equals(_LAYOUT, check_metadata=False):
        return None
    buffers = batch.to_struct_array().buffers()
    if any(b is not None for b in buffers[:2]) or any(b is not None for b in buffers[3::2]):
        return None  # a validity buffer: there are nulls
    if any(b is None for b in buffers[2::2]):
        return None
    offsets = buffers[_OFFSETS[0]]
    if not all(offsets.equals(buffers[i]) for i in _OFFSETS[1:]):
        return None
    return _Plain(batch, buffers, batch.num_rows)


def _describe(p: _Plain) -> bool:
    """Metadata, dtypes and padded shape; False where anything is off (the codec will say what)."""
    md = p.batch.schema.metadata or {}
    try:
        p.meta = _meta(md)
        p.dtypes = _dtypes(md.get(b"jetrl.dtypes", b"{}"))
        bounds = np.frombuffer(p.buffers[_OFFSETS[0]], dtype=_INT32, count=p.rows + 1)
        lengths = bounds[1:] - bounds[:-1]
        row_lengths = lengths.tolist()
        shortest, longest = min(row_lengths), max(row_lengths)
        p.seqlen = max(int(md.get(b"jetrl.seqlen", b"0")), longest)
    except Exception:  # odd metadata: decode_group raises the error it is known by
        return False
    p.total = total = int(bounds[-1])
    if p.meta is None or bounds[0] != 0 or shortest < 0 or not _sizes_fit(p.buffers, total, p.rows):
        return False
    if shortest < p.seqlen:
        p.mask = _positions(p.seqlen) < lengths[:, None]
    return True


def _sizes_fit(buffers: list[Any], total: int, rows: int) -> bool:
    """Every values buffer holds what the row split says (a corrupt message may not)."""
    for at, itemsize in _VALUE_SIZES:
        if buffers[at].size < total * itemsize:
            return False
    return buffers[_REWARD].size >= 4 * rows and buffers[_PROMPT_LEN].size >= 4 * rows


def _meta(md: dict[bytes, bytes]) -> TrajectoryMeta | None:
    """`table_meta` of metadata as the codec writes it; None for any other (the codec names the error)."""
    version = md.get(b"jetrl.schema", b"")
    if not version.isdigit() or int(version) not in SUPPORTED_SCHEMA_VERSIONS:
        return None
    return TrajectoryMeta(
        run=md[b"run"].decode(),
        prompt_id=md[b"prompt_id"].decode(),
        worker=md.get(b"worker", b"").decode(),
        head_version=int(md[b"head_version"]),
        tail_version=int(md[b"tail_version"]),
        is_eval=md.get(b"is_eval") == b"1",
    )


@functools.lru_cache(maxsize=64)
def _dtypes(raw: bytes) -> dict[str, np.dtype]:
    """`jetrl.dtypes` metadata -> numpy dtypes; a run's messages share a handful of values."""
    return {key: np.dtype(name) for key, name in json.loads(raw).items()}


@functools.lru_cache(maxsize=64)
def _positions(seqlen: int) -> np.ndarray:
    return np.arange(seqlen)
