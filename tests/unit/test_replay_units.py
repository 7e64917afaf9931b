"""Replay's pure parts: the flag spellings, settings rules, the Parquet form of a group (round trip to
identical tensors and metadata), and the header-only range filters."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from schemas.headers import rejection_headers, trajectory_headers
from schemas.trajectory import decode_group, encode_group
from services.common.entry import parse_settings, read_command_line
from services.common.settings import SettingsError, load_settings
from services.replay.parquet import ExportWriter, ParquetFormatError, group_rows, iter_records
from services.replay.reader import Record
from services.replay.settings import RangeSettings, ReplaySettings
from services.replay.source import skip_reason

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def ragged_group(seed: int, n: int = 3, extra: bool = True) -> dict[str, np.ndarray]:
    """A right-padded group with rows of different lengths, int64 ids, versions per token, and extras."""
    rng = np.random.default_rng(seed)
    seqlen = 9
    lengths = rng.integers(4, seqlen + 1, size=n)
    mask = (np.arange(seqlen)[None, :] < lengths[:, None]).astype(np.int64)
    loss = mask.copy()
    loss[:, :3] = 0
    out = {
        "input_ids": rng.integers(0, 48, size=(n, seqlen)) * mask,
        "attention_mask": mask,
        "loss_mask": loss,
        "logprobs": (-rng.random((n, seqlen)) * loss).astype(np.float32),
        "rewards": rng.random(n).astype(np.float32),
        "versions": np.where(loss > 0, seed % 4 + rng.integers(0, 2, size=(n, seqlen)), -1).astype(np.int64),
    }
    if extra:
        out["turns"] = rng.integers(1, 4, size=n).astype(np.int16)
        out["entropy"] = (rng.random((n, seqlen)) * mask).astype(np.float64)
    return out


def test_flags_are_spellings_of_range_settings() -> None:
    argv = ["--from-seq", "10", "--to-seq=20", "--since", "2026-01-01T00:00:00", "--follow", "run=x", "--kind=all",
            "source_run=live"]
    line = read_command_line(ReplaySettings, argv, "jetrl replay", "")
    assert sorted(line.overrides) == sorted(["range.from_seq=10", "range.to_seq=20", "range.since=2026-01-01T00:00:00",
                                             "range.follow=true", "range.kind=all", "run=x", "source_run=live"])
    s = parse_settings(ReplaySettings, argv[2:], "jetrl replay", "")  # from_seq or since, not both
    assert isinstance(s, ReplaySettings)
    assert (s.range.to_seq, s.range.since, s.range.follow, s.range.kind) == (20, T0, True, "all")
    assert (s.run, s.source_run) == ("x", "live")


def test_replay_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(SettingsError, match=r"source_run: .*name the recorded run"):
        load_settings(ReplaySettings, overrides=["run=offline"])
    with pytest.raises(SettingsError, match="needs its own name"):
        load_settings(ReplaySettings, overrides=["run=live", "source_run=live"])
    with pytest.raises(SettingsError, match="from_seq 9 is after to_seq 3"):
        load_settings(ReplaySettings, overrides=["run=o", "source_run=live", "range.from_seq=9", "range.to_seq=3"])
    with pytest.raises(SettingsError, match=r"feeder\.enabled"):
        load_settings(ReplaySettings, overrides=["run=o", "source_run=live", "feeder.enabled=true"])
    s = load_settings(ReplaySettings, overrides=["run=o", "source_run=live", "range.since=2026-01-01T00:00:00"])
    assert s.range.since == T0 and s.weights.transport == "none" and s.output_dir == ".jetrl/replay"


def test_parquet_round_trip_gives_identical_groups(tmp_path: Path) -> None:
    writer = ExportWriter(tmp_path / "x.parquet", row_group_rows=4)  # small row groups: groups straddle flushes
    originals = []  # what a trainer decodes from the recorded messages
    for i in range(5):
        data = encode_group(ragged_group(i), run="live", prompt_id=f"p{i}", worker="w1", is_eval=(i == 4))
        originals.append(decode_group(data).tensors)
        writer.add(group_rows(decode_group(data), seq=10 + i, time=T0))
    writer.close()
    records = list(iter_records([str(tmp_path)], RangeSettings(kind="all")))
    assert [r.seq for r in records] == [10, 11, 12, 13, 14]
    for i, (g, rec) in enumerate(zip(originals, records, strict=True)):
        back = decode_group(rec.data)
        assert back.meta.prompt_id == f"p{i}" and back.meta.worker == "w1" and back.meta.is_eval == (i == 4)
        assert rec.time == T0 and rec.headers == trajectory_headers(back.meta)
        assert back.tensors.keys() == g.keys()
        for k in g:
            assert back.tensors[k].dtype == g[k].dtype and np.array_equal(back.tensors[k], g[k]), k
    # range rules apply to the recorded values
    rng = RangeSettings(from_seq=11, to_seq=13)
    assert [r.seq for r in iter_records([str(tmp_path / "x.parquet")], rng)] == [11, 12, 13]
    assert [r.seq for r in iter_records([str(tmp_path)], RangeSettings(kind="eval"))] == [14]
    assert [r.seq for r in iter_records([str(tmp_path)], RangeSettings(), start_after=12)] == [13]


def test_a_group_with_a_column_the_file_lacks_is_refused_by_name(tmp_path: Path) -> None:
    writer = ExportWriter(tmp_path / "x.parquet")
    writer.add(group_rows(decode_group(encode_group(ragged_group(0, extra=False), run="r", prompt_id="a", worker="w")), 1, T0))
    with pytest.raises(ParquetFormatError, match="column 'turns'"):
        writer.add(group_rows(decode_group(encode_group(ragged_group(1), run="r", prompt_id="b", worker="w")), 2, T0))
    with pytest.raises(ParquetFormatError, match="'seq' is a reserved"):
        bad = ragged_group(2, extra=False) | {"seq": np.zeros(3, dtype=np.int32)}
        group_rows(decode_group(encode_group(bad, run="r", prompt_id="c", worker="w")), 3, T0)
    writer.close()


def test_range_filters_use_headers_only() -> None:
    def rec(headers: dict[str, str] | None, data: bytes = b"garbage") -> Record:
        return Record(1, T0, "jetrl.r.trajectories", data, headers)

    versions = {"Jetrl-Head-Version": "2", "Jetrl-Tail-Version": "4"}
    assert skip_reason(rec(rejection_headers("r", "p")), RangeSettings()) == "rejection"
    assert skip_reason(rec(versions), RangeSettings(min_version=3)) == "version"
    assert skip_reason(rec(versions), RangeSettings(max_version=3)) == "version"
    assert skip_reason(rec(versions), RangeSettings(min_version=2, max_version=4)) is None
    # no version headers: the body says; an unreadable body is left to the intake (malformed)
    body = encode_group(ragged_group(1, extra=False), run="r", prompt_id="p", worker="w")
    head = decode_group(body).meta.head_version
    assert skip_reason(rec(None, body), RangeSettings(min_version=head + 1)) == "version"
    assert skip_reason(rec(None), RangeSettings(min_version=1)) is None


@pytest.mark.parametrize("command", ["replay", "export", "import"])
def test_help_lists_the_range_settings_without_importing_torch(command: str) -> None:
    import subprocess
    import sys

    probe = (
        "import sys\nfrom services.cli import main\n"
        f"try:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n    pass\n"
        "print('HEAVY' if 'torch' in sys.modules else 'LIGHT')"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert "range.from_seq" in out.stdout and f"JETRL_{command.upper()}__" in out.stdout
    assert out.stdout.strip().endswith("LIGHT"), out.stdout[-300:]
