"""Replay decodes a pull's groups together (`decode_groups`): every message must come out exactly as
`decode_group` gives it - tensors bit for bit, dtypes, shapes, metadata - and every message the codec
refuses must fail with the codec's own error, whatever else is in the same pull."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest

from schemas.trajectory import DecodedGroup, decode_group, encode_group
from services.replay.decode import decode_groups


def group(seed: int, *, rows: int = 4, seqlen: int = 12, full: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.full(rows, seqlen) if full else rng.integers(1, seqlen + 1, size=rows)
    mask = (np.arange(seqlen)[None, :] < lengths[:, None]).astype(np.int64)
    loss = mask.copy()
    loss[:, :1] = 0
    return {
        "input_ids": rng.integers(0, 150_000, size=(rows, seqlen)) * mask,
        "attention_mask": mask,
        "loss_mask": loss,
        "logprobs": (-rng.random((rows, seqlen)) * loss).astype(np.float32),
        "rewards": rng.random(rows).astype(np.float32),
        "versions": np.where(loss > 0, seed % 5, -1).astype(np.int64),
    }


def rewrite(data: bytes, fn: Callable[[pa.Table], pa.Table], *, batches: int = 1) -> bytes:
    table = fn(pa.ipc.open_stream(data).read_all())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for part in np.array_split(np.arange(table.num_rows), batches):
            writer.write_table(table.slice(int(part[0]), len(part)))
    return sink.getvalue().to_pybytes()


def encode(tensors: dict[str, np.ndarray], pid: str = "p", **kw: object) -> bytes:
    return encode_group(tensors, run="r", prompt_id=pid, worker="w", **kw)  # type: ignore[arg-type]


def assert_same(expected: DecodedGroup, got: DecodedGroup | Exception) -> None:
    assert isinstance(got, DecodedGroup), got
    assert got.meta == expected.meta
    assert list(got.tensors) == list(expected.tensors)
    for key, want in expected.tensors.items():
        have = got.tensors[key]
        assert (have.dtype, have.shape) == (want.dtype, want.shape), key
        assert have.tobytes() == want.tobytes(), key


def test_a_pull_decodes_bit_for_bit_as_the_codec() -> None:
    int32_ids = group(3) | {"input_ids": group(3)["input_ids"].astype(np.int32)}
    with_prompt_len = group(4) | {"prompt_len": np.full(4, 2, dtype=np.int16)}
    with_extras = group(5) | {"turns": np.arange(4, dtype=np.int16), "entropy": np.ones((4, 12))}
    empty_rows = group(6) | {"attention_mask": np.zeros((4, 12), np.int64), "loss_mask": np.zeros((4, 12), np.int64)}
    messages = [
        encode(group(1), "ragged"),
        encode(group(2, full=True), "full rows"),
        encode(int32_ids, "int32 ids"),
        encode(with_prompt_len, "prompt_len"),
        encode(with_extras, "extra columns"),
        encode(empty_rows | {"versions": np.full((4, 12), -1)}, "no tokens"),
        encode(group(7, rows=1, seqlen=3000), "one long row", is_eval=True),
        rewrite(encode(group(8, rows=6), "two batches"), lambda t: t, batches=2),
    ]
    for data, got in zip(messages, decode_groups(messages), strict=True):
        assert_same(decode_group(data), got)


def _bump_schema(table: pa.Table) -> pa.Table:
    return table.replace_schema_metadata(dict(table.schema.metadata) | {b"jetrl.schema": b"99"})


def _shift_logprobs(table: pa.Table) -> pa.Table:
    rows = table.column("logprobs").to_pylist()
    rows[0], rows[1] = rows[0] + [0.0], rows[1][:-1]
    i = table.column_names.index("logprobs")
    return table.set_column(i, table.schema.field(i), pa.array(rows, type=pa.list_(pa.float32())))


def _null_row(table: pa.Table) -> pa.Table:
    rows = table.column("versions").to_pylist()
    rows[2] = None
    i = table.column_names.index("versions")
    return table.set_column(i, table.schema.field(i), pa.array(rows, type=pa.list_(pa.int32())))


def test_a_message_the_codec_refuses_fails_alone_with_the_codecs_error() -> None:
    good = encode(group(1), "good")
    full = group(2, full=True)
    bad = [
        good[: len(good) // 2],
        b"not arrow at all",
        rewrite(encode(group(3)), _bump_schema),
        rewrite(encode(full), _shift_logprobs),
        rewrite(encode(group(4)), _null_row),
        rewrite(encode(group(5)), lambda t: t.drop_columns(["versions"])),
        rewrite(encode(group(6)), lambda t: t.replace_schema_metadata(dict(t.schema.metadata) | {b"jetrl.dtypes": b"{"})),
    ]
    messages = [good, *bad, good]
    results = decode_groups(messages)
    assert_same(decode_group(good), results[0])
    assert_same(decode_group(good), results[-1])
    for data, got in zip(bad, results[1:-1], strict=True):
        with pytest.raises(Exception) as expected:
            decode_group(data)
        assert isinstance(got, Exception)
        assert (type(got), str(got)) == (expected.type, str(expected.value))
