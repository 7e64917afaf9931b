"""The Arrow trajectory codec: a padded tensor dict <-> one Arrow IPC message with ragged columns.

One message holds one group (one row per sample). Token columns are `list<...>` columns whose offsets
come from the attention mask; every per-token column of a message shares the same offsets. Padding is
not stored: it decodes as 0. Original dtypes are kept in the schema metadata so a round trip gives the
same arrays, dtype included. Nothing here loops over tokens in Python: rows are copied as slices.

Inputs may be numpy arrays or torch tensors (duck-typed; torch is never imported here). Decoding
gives numpy arrays; `to_torch` converts them.
"""

from schemas.trajectory.contract import (
    REQUIRED_KEYS,
    SAMPLE_COLUMNS,
    SUPPORTED_SCHEMA_VERSIONS,
    TOKEN_COLUMNS,
    TRAJECTORY_SCHEMA_VERSION,
    DecodedGroup,
    TrajectoryError,
    TrajectoryMeta,
)
from schemas.trajectory.decode import decode_group, table_meta, table_to_padded, to_torch
from schemas.trajectory.encode import encode_group, encode_group_with_meta, encode_table, group_to_batch, group_to_table

__all__ = [
    "REQUIRED_KEYS",
    "SAMPLE_COLUMNS",
    "SUPPORTED_SCHEMA_VERSIONS",
    "TOKEN_COLUMNS",
    "TRAJECTORY_SCHEMA_VERSION",
    "DecodedGroup",
    "TrajectoryError",
    "TrajectoryMeta",
    "decode_group",
    "encode_group",
    "encode_group_with_meta",
    "encode_table",
    "group_to_batch",
    "group_to_table",
    "table_meta",
    "table_to_padded",
    "to_torch",
]
