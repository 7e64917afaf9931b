"""The Arrow trajectory codec: lossless round trips and errors that name the bad field."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from schemas.trajectory import TrajectoryError, decode_group, encode_group, group_to_table, to_torch


def random_group(rng: np.random.Generator, batch: int, seqlen: int, extras: bool = True) -> dict[str, np.ndarray]:
    lengths = rng.integers(1, seqlen + 1, batch)
    lengths[rng.integers(batch)] = seqlen  # at least one row uses the whole width
    mask = (np.arange(seqlen)[None, :] < lengths[:, None]).astype(np.int64)
    prompt_len = np.minimum(rng.integers(1, 6, batch), lengths)
    completion = (np.arange(seqlen)[None, :] >= prompt_len[:, None]) & (mask == 1)
    group = {
        "input_ids": rng.integers(0, 150_000, (batch, seqlen)) * mask,
        "attention_mask": mask,
        "loss_mask": completion.astype(np.int64),
        "logprobs": np.where(completion, -rng.random((batch, seqlen)), 0).astype(np.float32),
        "rewards": rng.random(batch).astype(np.float32),
        "versions": np.where(completion, rng.integers(0, 9, (batch, seqlen)), -1 * mask).astype(np.int64),
    }
    if extras:
        group["advantages"] = np.where(mask == 1, rng.standard_normal((batch, seqlen)), 0).astype(np.float32)
        group["turn"] = rng.integers(0, 4, batch).astype(np.int16)
    return group


@pytest.mark.parametrize("seed", range(8))
def test_round_trip_is_bit_exact_with_extra_columns(seed: int) -> None:
    rng = np.random.default_rng(seed)
    group = random_group(rng, batch=int(rng.integers(1, 9)), seqlen=int(rng.integers(1, 300)))
    decoded = decode_group(encode_group(group, run="r1", prompt_id=f"p{seed}", worker="w0"))
    assert set(decoded.tensors) == set(group)
    for key, arr in group.items():
        out = decoded.tensors[key]
        assert out.dtype == arr.dtype, key
        assert out.shape == arr.shape, key
        assert out.tobytes() == arr.tobytes(), key  # bit-exact, including float bit patterns


def test_metadata_carries_versions_and_ids() -> None:
    group = random_group(np.random.default_rng(1), 4, 32, extras=False)
    group["versions"][group["versions"] >= 0] = 5
    group["versions"][0, -1] = 3
    group["attention_mask"][0, :] = 1
    decoded = decode_group(encode_group(group, run="exp", prompt_id="e0-17", worker="host-1", is_eval=True))
    meta = decoded.meta
    assert (meta.run, meta.prompt_id, meta.worker, meta.is_eval) == ("exp", "e0-17", "host-1", True)
    assert (meta.head_version, meta.tail_version) == (3, 5)


def test_prompt_len_is_derived_from_the_loss_mask() -> None:
    group = random_group(np.random.default_rng(2), 3, 20, extras=False)
    table, _ = group_to_table(group, run="r", prompt_id="p", worker="w")
    active = group["loss_mask"] != 0
    # a row with no completion token is all prompt
    expected = np.where(active.any(axis=1), active.argmax(axis=1), group["attention_mask"].sum(axis=1))
    assert table.column("prompt_len").to_pylist() == expected.tolist()


def test_to_torch_keeps_dtypes() -> None:
    group = random_group(np.random.default_rng(3), 2, 8, extras=False)
    tensors = to_torch(decode_group(encode_group(group, run="r", prompt_id="p", worker="w")).tensors)
    assert str(tensors["input_ids"].dtype) == "torch.int64"
    assert str(tensors["logprobs"].dtype) == "torch.float32"


def test_torch_tensors_are_accepted() -> None:
    import torch

    group = {k: torch.from_numpy(v) for k, v in random_group(np.random.default_rng(4), 2, 8).items()}
    out = decode_group(encode_group(group, run="r", prompt_id="p", worker="w")).tensors
    assert np.array_equal(out["input_ids"], group["input_ids"].numpy())


# ----------------------------------------------------------------------------------------- bad input


def encode(group: dict[str, object]) -> bytes:
    return encode_group(group, run="r", prompt_id="p", worker="w")


@pytest.fixture
def group() -> dict[str, np.ndarray]:
    return random_group(np.random.default_rng(5), 3, 16)


def test_wrong_dtype_names_the_field(group: dict[str, np.ndarray]) -> None:
    group["input_ids"] = group["input_ids"].astype(np.float32)
    with pytest.raises(TrajectoryError, match="input_ids: dtype float32"):
        encode(group)


def test_float64_logprobs_are_refused_not_truncated(group: dict[str, np.ndarray]) -> None:
    group["logprobs"] = group["logprobs"].astype(np.float64)
    with pytest.raises(TrajectoryError, match="logprobs: float64 would lose precision"):
        encode(group)


def test_ids_beyond_int32_are_refused(group: dict[str, np.ndarray]) -> None:
    group["input_ids"][0, 0] = 2**40
    with pytest.raises(TrajectoryError, match="input_ids: values out of int32 range"):
        encode(group)


def test_shape_mismatch_names_the_field(group: dict[str, np.ndarray]) -> None:
    group["logprobs"] = group["logprobs"][:, :-1]
    with pytest.raises(TrajectoryError, match=r"logprobs: shape \(3, 15\) does not match"):
        encode(group)


def test_left_padding_is_refused(group: dict[str, np.ndarray]) -> None:
    group["attention_mask"][0] = 0
    group["attention_mask"][0, -2:] = 1
    with pytest.raises(TrajectoryError, match="attention_mask: must be right-padded"):
        encode(group)


def test_missing_key_is_named(group: dict[str, np.ndarray]) -> None:
    del group["versions"]
    with pytest.raises(TrajectoryError, match="missing required keys: versions"):
        encode(group)


def test_bad_extra_shape_is_named(group: dict[str, np.ndarray]) -> None:
    group["weird"] = np.zeros((3, 2, 2))
    with pytest.raises(TrajectoryError, match="weird: extra keys must be per-sample"):
        encode(group)


def test_truncated_bytes_raise(group: dict[str, np.ndarray]) -> None:
    data = encode(group)
    with pytest.raises(TrajectoryError, match="truncated or corrupt"):
        decode_group(data[: len(data) // 2])
    with pytest.raises(TrajectoryError, match="truncated or corrupt"):
        decode_group(b"not arrow at all")


def _rewrite(data: bytes, fn) -> bytes:  # type: ignore[no-untyped-def]
    table = fn(pa.ipc.open_stream(data).read_all())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def test_unknown_schema_version_raises(group: dict[str, np.ndarray]) -> None:
    def bump(table: pa.Table) -> pa.Table:
        md = dict(table.schema.metadata)
        md[b"jetrl.schema"] = b"99"
        return table.replace_schema_metadata(md)

    with pytest.raises(TrajectoryError, match="unsupported trajectory schema version '99'"):
        decode_group(_rewrite(encode(group), bump))


def test_ragged_mismatch_between_columns_raises(group: dict[str, np.ndarray]) -> None:
    def shift(table: pa.Table) -> pa.Table:
        rows = table.column("logprobs").to_pylist()
        rows[0], rows[1] = rows[0] + [0.0], rows[1][:-1]
        idx = table.column_names.index("logprobs")
        return table.set_column(idx, table.schema.field(idx), pa.array(rows, type=pa.list_(pa.float32())))

    group["attention_mask"][:2] = 1
    with pytest.raises(TrajectoryError, match="logprobs: row lengths differ from input_ids"):
        decode_group(_rewrite(encode(group), shift))


def test_missing_column_raises(group: dict[str, np.ndarray]) -> None:
    with pytest.raises(TrajectoryError, match="versions: required column missing"):
        decode_group(_rewrite(encode(group), lambda t: t.drop_columns(["versions"])))


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("jetrl.dtypes", '{"input_ids": "foo"}', "jetrl.dtypes: input_ids: not a numeric dtype"),
        ("jetrl.dtypes", "[1, 2]", "jetrl.dtypes: expected an object"),
        ("jetrl.dtypes", '{"rewards": 3}', "jetrl.dtypes: rewards: not a numeric dtype"),
        ("jetrl.dtypes", '{"input_ids": "U8"}', "jetrl.dtypes: input_ids: not a numeric dtype"),
        ("jetrl.seqlen", "abc", "jetrl.seqlen: not a length"),
        ("head_version", "x", "schema metadata: missing or bad field"),
        ("run", b"\xff\xfe", "malformed trajectory message"),
    ],
)
def test_malformed_metadata_is_a_trajectory_error_naming_the_field(
    group: dict[str, np.ndarray], key: str, value: str | bytes, named: str
) -> None:
    """Whatever a message's metadata holds, decoding fails with TrajectoryError (which every consumer
    terminates and counts), never with another exception that would escape and crash the service."""

    def corrupt(table: pa.Table) -> pa.Table:
        md = dict(table.schema.metadata)
        md[key.encode()] = value if isinstance(value, bytes) else value.encode()
        return table.replace_schema_metadata(md)

    with pytest.raises(TrajectoryError, match=named):
        decode_group(_rewrite(encode(group), corrupt))
