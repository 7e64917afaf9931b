"""The trajectory contract shared by the encoder and the decoder: schema version, columns, metadata, errors.

A group travels as one Arrow IPC stream message (one row per sample). Token columns are `list<...>`
columns whose offsets come from the attention mask; every per-token column of a message shares the
same offsets. Padding is not stored: it decodes as 0. Original dtypes are kept in the schema metadata
(`jetrl.dtypes`) so a round trip gives the same arrays, dtype included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

TRAJECTORY_SCHEMA_VERSION = 1
SCHEMA_TEXT = str(TRAJECTORY_SCHEMA_VERSION)
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
REQUIRED_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "rewards", "versions")
RESERVED_ARROW_NAMES = {name for name, _ in (*TOKEN_COLUMNS.values(), *SAMPLE_COLUMNS.values())}


class TrajectoryError(ValueError):
    """A tensor dict or an Arrow message that breaks the trajectory contract; the text names the field.

    `cause` sorts the errors a consumer counts apart: `malformed` (does not decode), `length_mismatch`
    (lengths disagree with each other or with the metadata), `too_long` (rows longer than the
    consumer's limit). `meta`: the message's metadata when it could be read (who sent what)."""

    def __init__(self, message: str, cause: str = "malformed") -> None:
        super().__init__(message)
        self.cause = cause
        self.meta: TrajectoryMeta | None = None


@dataclass(frozen=True)
class TrajectoryMeta:
    """The schema metadata of one trajectory message."""

    run: str
    prompt_id: str
    worker: str
    head_version: int
    """Oldest weight version among the group's trained tokens (loss_mask != 0), -1 if none is trained.
    Prompt and feedback tokens do not count, whatever version they are tagged with."""
    tail_version: int
    """Newest weight version among the trained tokens."""
    is_eval: bool = False
    workflow: str = ""
    """The workflow that produced the group (schema metadata `workflow`; "" when the producer did not
    say), so a consumer that finds the group impossible can name who made it."""


@dataclass(frozen=True)
class DecodedGroup:
    tensors: dict[str, np.ndarray]
    meta: TrajectoryMeta
    table: pa.Table


def pooled_flat(size: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialised 1-d array in Arrow's memory pool, which keeps freed blocks for reuse: coding
    one group after another then writes to warm memory instead of faulting in fresh pages from the
    C allocator at every call (which on a VM costs more than the coding itself)."""
    return np.frombuffer(pa.allocate_buffer(size * dtype.itemsize), dtype=dtype)


def pooled(shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """`pooled_flat` in a padded 2-d shape."""
    return pooled_flat(shape[0] * shape[1], dtype).reshape(shape)
