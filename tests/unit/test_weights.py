"""Pure parts of weight sync: file hashing and verification, version retention, URIs, settings, the
status rendering."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.messages import WeightFile
from services.common.settings import SettingsError, load_settings
from services.status.weights import ServerWeights, WeightsStatus, render_weights
from services.weights.agent.server_client import parse_version
from services.weights.files import (
    ChecksumError,
    checkpoint_files,
    copy_hashed,
    parallel,
    parse_uri,
    safe_name,
    sha256_file,
    shard_bytes,
    verify_file,
    versions_to_drop,
)
from services.weights.settings import WeightsSettings


def test_copy_hashed_copies_and_hashes(tmp_path: Path) -> None:
    src = tmp_path / "a.bin"
    src.write_bytes(b"x" * 5_000_001)
    entry = copy_hashed(src, tmp_path / "out" / "sub" / "a.bin", "sub/a.bin")
    assert (tmp_path / "out" / "sub" / "a.bin").read_bytes() == src.read_bytes()
    assert entry == WeightFile(name="sub/a.bin", sha256=hashlib.sha256(src.read_bytes()).hexdigest(), size=5_000_001)


def test_sha256_file_matches_hashlib_including_empty_files(tmp_path: Path) -> None:
    for size in (0, 1, 3 * 2**18 + 5):
        path = tmp_path / f"f{size}"
        data = bytes(i % 251 for i in range(size))
        path.write_bytes(data)
        assert sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_shard_size_splits_small_models_for_every_core_and_caps_big_ones() -> None:
    # a 100 MB model is four 32 MB shards (hashed on every core at both ends), a 1 GB one eight
    assert shard_bytes(100_000_000) == 32_000_000
    assert shard_bytes(1_000_000_000) == 125_000_000
    # a 7B model in float32 is not cut into thousands of files, nor a tiny one below 32 MB
    assert shard_bytes(28_000_000_000) == 512_000_000
    assert shard_bytes(1_000_000) == 32_000_000


def test_parallel_starts_the_costliest_first_and_keeps_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("services.weights.files.os.cpu_count", lambda: 1)  # one worker: start order is visible
    started: list[int] = []

    def work(size: int) -> int:
        started.append(size)
        return size * 10

    assert parallel(work, [5, 50, 1, 20], cost=lambda size: size) == [50, 500, 10, 200]
    assert started == [50, 20, 5, 1]
    started.clear()
    assert parallel(work, [5, 50, 1]) == [50, 500, 10]
    assert started == [5, 50, 1]


def test_verify_file_names_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"good bytes")
    good = WeightFile(name="model.safetensors", sha256=hashlib.sha256(b"good bytes").hexdigest(), size=10)
    verify_file(path, good)
    path.write_bytes(b"evil bytes")  # same size, different content
    with pytest.raises(ChecksumError, match=r"model\.safetensors: sha256"):
        verify_file(path, good)
    path.write_bytes(b"short")
    with pytest.raises(ChecksumError, match="size 5 != announced 10"):
        verify_file(path, good)
    path.unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        verify_file(path, good)


def test_checkpoint_files_requires_config_and_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        checkpoint_files(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"w")
    (tmp_path / ".hidden").write_text("tmp")
    assert [p.name for p in checkpoint_files(tmp_path)] == ["config.json", "model.safetensors"]


def test_versions_to_drop_keeps_newest_and_protected() -> None:
    assert versions_to_drop({1, 2, 3, 4, 5}, keep=2) == [1, 2, 3]
    assert versions_to_drop({1, 2, 3, 4, 5}, keep=2, protect={1}) == [2, 3]
    assert versions_to_drop({7}, keep=3) == []


def test_parse_uri_both_schemes_and_refuses_others() -> None:
    obj = parse_uri("nats-os://WEIGHTS/run1/v3")
    assert (obj.scheme, obj.bucket, obj.prefix) == ("nats-os", "WEIGHTS", "run1/v3")
    shared = parse_uri("file:///mnt/shared/v3")
    assert (shared.scheme, shared.path) == ("file", Path("/mnt/shared/v3"))
    with pytest.raises(ValueError, match="expected nats-os"):
        parse_uri("s3://bucket/v3")


def test_safe_name_refuses_escapes() -> None:
    assert safe_name("sub/model.safetensors") == "sub/model.safetensors"
    for bad in ("../x", "/etc/passwd", "a/../../b"):
        with pytest.raises(ValueError, match="plain relative path"):
            safe_name(bad)


def test_parse_version_maps_sglang_default_to_zero() -> None:
    assert parse_version("default") == 0
    assert parse_version("12") == 12
    with pytest.raises(ValueError):
        parse_version("v12")


def test_settings_validate_server_and_keep_local() -> None:
    s = load_settings(WeightsSettings, None, ["server=http://127.0.0.1:30001/", "run=r1"])
    assert s.server == "http://127.0.0.1:30001" and s.server_name == "http://127.0.0.1:30001"
    with pytest.raises(SettingsError, match="server"):
        load_settings(WeightsSettings, None, ["server=127.0.0.1:30001"])
    with pytest.raises(SettingsError, match="keep_local"):
        load_settings(WeightsSettings, None, ["keep_local=0"])


def test_render_weights_shows_lag_and_failures() -> None:
    status = WeightsStatus(
        run="r",
        published_version=5,
        published_step=5,
        published_at=100.0,
        uri="nats-os://WEIGHTS/r/v5",
        servers=[
            ServerWeights("http://a:1", loaded_version=5, loaded_at=101.0, load_seconds=0.5, lag=0),
            ServerWeights("http://b:2", loaded_version=3, loaded_at=90.0, load_seconds=0.4, lag=2,
                          last_failure="sha256 mismatch", failed_version=4, failed_at=95.0),
        ],
    )
    text = render_weights(status, now=110.0)
    assert "published: v5" in text
    a_line = next(line for line in text.splitlines() if "http://a:1" in line)
    b_line = next(line for line in text.splitlines() if "http://b:2" in line)
    assert "lag 0" in a_line and "FAILED" not in a_line
    assert "lag 2" in b_line and "LAST LOAD FAILED v4: sha256 mismatch" in b_line


def test_help_is_instant_and_lists_settings() -> None:
    for cmd, key in (("weights", "cache_dir"), ("status", "format")):
        code = (
            "import sys\nfrom services.cli import main\n"
            f"try:\n    main(['{cmd}', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert key in out, f"jetrl {cmd} --help does not list {key}"
        assert out.strip().endswith("TORCH False"), f"jetrl {cmd} --help imported torch"


def test_an_announcement_older_by_epoch_and_version_is_refused_as_a_replay() -> None:
    from schemas.messages import WeightsPublished
    from services.weights.trust import Freshness, Refused

    def ann(epoch: int, version: int, run: str = "r") -> WeightsPublished:
        return WeightsPublished(run=run, version=version, uri="", files=[], step=version, epoch=epoch)

    fresh = Freshness("r")
    for a in (ann(10, 5), ann(10, 5), ann(10, 6), ann(11, 2)):  # a re-read, a newer version, a resumed trainer
        fresh.check(a)
        fresh.accept(a)
    for old, cause in ((ann(11, 1), "replayed"), (ann(10, 9), "replayed"), (ann(12, 9, run="other"), "other_run")):
        with pytest.raises(Refused) as exc:
            fresh.check(old)
        assert exc.value.cause == cause
    assert fresh.newest == (11, 2)
