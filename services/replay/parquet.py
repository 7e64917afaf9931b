"""The Parquet form of a recording: one row per sample, the Arrow trajectory columns plus the message
metadata as columns, so a group comes back identical (tensors, dtypes, padding length, metadata).

Metadata columns: `seq` (stream sequence), `timestamp` (UTC), `run`, `prompt_id`, `worker`,
`head_version`, `tail_version`, `is_eval`, `sample` (row within its group), and the codec's own
`jetrl_dtypes` / `jetrl_seqlen`. Rows of one group are consecutive and share `seq`; a group never
straddles two row groups of a file this module writes (files from elsewhere may split them: handled).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.headers import trajectory_headers
from schemas.subjects import Subjects
from schemas.trajectory import (
    SAMPLE_COLUMNS,
    TOKEN_COLUMNS,
    TRAJECTORY_SCHEMA_VERSION,
    DecodedGroup,
    TrajectoryMeta,
    encode_table,
)
from services.replay.reader import Record
from services.replay.settings import RangeSettings

EXPORT_FORMAT = "1"
META_COLUMNS = ("seq", "timestamp", "run", "prompt_id", "worker", "head_version", "tail_version", "is_eval", "sample",
                "jetrl_dtypes", "jetrl_seqlen")
_CODEC_COLUMNS = {name for name, _ in (*TOKEN_COLUMNS.values(), *SAMPLE_COLUMNS.values())}


class ParquetFormatError(ValueError):
    """A group that cannot be written, or a file that is not a `jetrl export`; the text names the column."""


# ------------------------------------------------------------------------------------------- write


def group_rows(group: DecodedGroup, seq: int, time: datetime) -> pa.Table:
    """A decoded group -> its rows: the codec's columns plus the metadata columns."""
    table = group.table.replace_schema_metadata(None)
    clash = [c for c in table.column_names if c in META_COLUMNS]
    if clash:
        raise ParquetFormatError(f"group {group.meta.prompt_id} (seq {seq}): column {clash[0]!r} is a reserved export column")
    md = {k.decode(): v.decode() for k, v in (group.table.schema.metadata or {}).items()}
    n, m = table.num_rows, group.meta
    extra = {
        "seq": pa.array(np.full(n, seq, dtype=np.int64)),
        "timestamp": pa.array([time] * n, type=pa.timestamp("us", tz="UTC")),
        "run": pa.array([m.run] * n, type=pa.string()),
        "prompt_id": pa.array([m.prompt_id] * n, type=pa.string()),
        "worker": pa.array([m.worker] * n, type=pa.string()),
        "head_version": pa.array(np.full(n, m.head_version, dtype=np.int32)),
        "tail_version": pa.array(np.full(n, m.tail_version, dtype=np.int32)),
        "is_eval": pa.array(np.full(n, m.is_eval, dtype=bool)),
        "sample": pa.array(np.arange(n, dtype=np.int32)),
        "jetrl_dtypes": pa.array([md.get("jetrl.dtypes", "{}")] * n, type=pa.string()),
        "jetrl_seqlen": pa.array(np.full(n, int(md.get("jetrl.seqlen", 0)), dtype=np.int32)),
    }
    for name, col in extra.items():
        table = table.append_column(name, col)
    return table


class ExportWriter:
    """Buffers whole groups and writes them as row groups of about `row_group_rows` samples."""

    def __init__(self, path: str | Path, row_group_rows: int = 8192, compression: str = "zstd") -> None:
        self.path = Path(path)
        self.row_group_rows = row_group_rows
        self.compression = None if compression == "none" else compression
        self._writer: pq.ParquetWriter | None = None
        self._schema: pa.Schema | None = None
        self._buffer: list[pa.Table] = []
        self._buffered = 0
        self.groups = 0
        self.rows = 0

    def add(self, rows: pa.Table) -> None:
        if self._schema is None:
            meta = {"jetrl.export": EXPORT_FORMAT, "jetrl.schema": str(TRAJECTORY_SCHEMA_VERSION)}
            self._schema = rows.schema.with_metadata(meta)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.path, self._schema, compression=self.compression)
        self._buffer.append(self._conform(rows))
        self._buffered += rows.num_rows
        self.groups += 1
        self.rows += rows.num_rows
        if self._buffered >= self.row_group_rows:
            self.flush()

    def _conform(self, rows: pa.Table) -> pa.Table:
        """Fit a group to the file's schema: missing extra columns become nulls; new ones are refused."""
        assert self._schema is not None
        if rows.schema.equals(self._schema, check_metadata=False):
            return rows
        new = [c for c in rows.column_names if c not in self._schema.names]
        if new:
            seq = rows.column("seq")[0].as_py()
            raise ParquetFormatError(
                f"group at seq {seq} has column {new[0]!r} that earlier groups lack: export such ranges to separate files")
        cols = [rows.column(f.name) if f.name in rows.column_names else pa.nulls(rows.num_rows, f.type) for f in self._schema]
        try:
            return pa.Table.from_arrays(cols, schema=self._schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ParquetFormatError(
                f"group at seq {rows.column('seq')[0].as_py()}: column types differ from earlier groups: {exc}"
            ) from exc

    def flush(self) -> None:
        if self._buffer and self._writer is not None:
            self._writer.write_table(pa.concat_tables(self._buffer), row_group_size=max(self._buffered, 1))
        self._buffer, self._buffered = [], 0

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()


# ------------------------------------------------------------------------------------------- read


def rows_to_group(rows: pa.Table) -> tuple[pa.Table, TrajectoryMeta, int, datetime]:
    """The rows of one group -> (its Arrow table as the codec wrote it, meta, seq, time)."""
    first = {name: rows.column(name)[0].as_py() for name in META_COLUMNS}
    meta = TrajectoryMeta(run=first["run"], prompt_id=first["prompt_id"], worker=first["worker"] or "",
                          head_version=int(first["head_version"]), tail_version=int(first["tail_version"]),
                          is_eval=bool(first["is_eval"]))
    dtypes = json.loads(first["jetrl_dtypes"] or "{}")
    keep = [c for c in rows.column_names if c not in META_COLUMNS and (c in _CODEC_COLUMNS or c in dtypes)]
    table = rows.select(keep).replace_schema_metadata({
        "jetrl.schema": str(TRAJECTORY_SCHEMA_VERSION), "run": meta.run, "prompt_id": meta.prompt_id,
        "worker": meta.worker, "head_version": str(meta.head_version), "tail_version": str(meta.tail_version),
        "is_eval": "1" if meta.is_eval else "0", "jetrl.dtypes": first["jetrl_dtypes"] or "{}",
        "jetrl.seqlen": str(first["jetrl_seqlen"]),
    })
    time = first["timestamp"]
    if time is not None and time.tzinfo is None:
        time = time.replace(tzinfo=UTC)
    return table, meta, int(first["seq"]), time


def expand(paths: list[str]) -> list[Path]:
    """Files as given; directories -> their *.parquet files, sorted."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(p.glob("*.parquet")))
        elif p.exists():
            out.append(p)
        else:
            raise FileNotFoundError(f"parquet: no such file or directory: {p}")
    return out


def _split_groups(table: pa.Table) -> list[pa.Table]:
    seqs = table.column("seq").to_numpy()
    cuts = np.flatnonzero(np.diff(seqs)) + 1
    bounds = [0, *cuts.tolist(), len(seqs)]
    return [table.slice(a, b - a) for a, b in itertools.pairwise(bounds) if b > a]


def iter_groups(paths: list[str]) -> Iterator[pa.Table]:
    """Every group's rows, in file and row order; a group split across row groups is joined."""
    for path in expand(paths):
        pf = pq.ParquetFile(path)
        missing = [c for c in META_COLUMNS if c not in pf.schema_arrow.names]
        if missing:
            raise ParquetFormatError(f"{path}: not a `jetrl export` file (no {missing[0]!r} column)")
        carry: pa.Table | None = None
        for i in range(pf.num_row_groups):
            for part in _split_groups(pf.read_row_group(i)):
                if carry is not None and part.column("seq")[0].as_py() == carry.column("seq")[0].as_py():
                    carry = pa.concat_tables([carry, part])
                    continue
                if carry is not None:
                    yield carry
                carry = part
        if carry is not None:
            yield carry


def iter_records(paths: list[str], rng: RangeSettings, *, run: str | None = None, start_after: int = 0) -> Iterator[Record]:
    """The groups of Parquet exports as trajectory messages, with the same range rules as the stream
    (seq and time bounds on the recorded values, train/eval); `run` keeps only that run's rows."""
    for rows in iter_groups(paths):
        table, meta, seq, time = rows_to_group(rows)
        if seq <= start_after or seq < rng.from_seq or (rng.to_seq and seq > rng.to_seq):
            continue
        if (rng.since and time < rng.since) or (rng.until and time > rng.until):
            continue
        if run is not None and meta.run != run:
            continue
        if (rng.kind == "train" and meta.is_eval) or (rng.kind == "eval" and not meta.is_eval):
            continue
        subjects = Subjects(meta.run)
        subject = subjects.trajectories_eval if meta.is_eval else subjects.trajectories
        yield Record(seq, time, subject, encode_table(table), trajectory_headers(meta))
