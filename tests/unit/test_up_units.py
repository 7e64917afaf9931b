"""`jetrl up` before it starts anything: a fresh run directory every time, and bad configs refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.bus.nats_server import NatsServer
from services.runs import URL_FILE
from services.up.rundir import RunDirInUse, prepare_run_dir

ROOT = Path(__file__).resolve().parents[2]


def used_run(root: Path, run: str, last: float) -> Path:
    """A run directory as a finished `jetrl up` leaves it, last changed at `last`."""
    run_dir = root / run
    (run_dir / "nats" / "jetstream").mkdir(parents=True)
    (run_dir / "nats" / "jetstream" / "msgs.blk").write_bytes(b"old trajectories")
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "trainer.log").write_text("old log\n")
    (run_dir / URL_FILE).write_text("nats://127.0.0.1:1\n")  # left by a run that was killed
    older = last - 3600
    for top, dirs, files in os.walk(run_dir, topdown=False):
        for name in (*dirs, *files):
            os.utime(os.path.join(top, name), (older, older))
    os.utime(run_dir, (older, older))
    os.utime(run_dir / "logs" / "trainer.log", (last, last))  # the newest change is deep inside
    return run_dir


def stamp(t: float) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(t))


def test_a_used_run_directory_is_moved_aside_and_the_new_run_starts_empty(tmp_path: Path) -> None:
    last = time.mktime((2026, 3, 4, 5, 6, 7, 0, 0, -1))
    used_run(tmp_path, "demo", last)
    run_dir, kept = prepare_run_dir(tmp_path, "demo")
    assert run_dir == tmp_path.resolve() / "demo" and run_dir.is_dir() and not any(run_dir.iterdir())
    assert kept == tmp_path.resolve() / f"demo.{stamp(last)}"
    assert (kept / "nats" / "jetstream" / "msgs.blk").read_bytes() == b"old trajectories"  # nothing lost
    assert (kept / "logs" / "trainer.log").read_text() == "old log\n"

    # an empty run directory (or none) is simply used
    assert prepare_run_dir(tmp_path, "demo") == (run_dir, None)
    assert prepare_run_dir(tmp_path, "other") == (tmp_path.resolve() / "other", None)

    # a second used run last changed in the same second does not overwrite the first one kept
    used_run(tmp_path, "again", last)
    used_run(tmp_path / "tmp2", "again", last)
    _, first = prepare_run_dir(tmp_path, "again")
    (tmp_path / "again").rmdir()
    (tmp_path / "tmp2" / "again").rename(tmp_path / "again")
    _, second = prepare_run_dir(tmp_path, "again")
    assert first is not None and second is not None
    assert first.name == f"again.{stamp(last)}" and second.name == f"again.{stamp(last)}-2"


def test_the_directory_of_a_run_still_going_is_left_alone(tmp_path: Path, nats_server: NatsServer) -> None:
    runs = tmp_path / "runs"
    run_dir = used_run(runs, "demo", time.time())
    (run_dir / URL_FILE).write_text(nats_server.url)  # what a live `jetrl up` writes
    with pytest.raises(RunDirInUse, match="still running"):
        prepare_run_dir(runs, "demo")
    assert (run_dir / "logs" / "trainer.log").exists() and [p.name for p in runs.iterdir()] == ["demo"]


def up(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.up", *args, f"run_dir={tmp_path / 'runs'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (None, "no such file"),
        ("up: {rollout_workers: 0}\n", "rollout_workers"),
        ("rolout: {}\n", "unknown top-level section"),
        ("rollout: {max_concurency: 3}\n", "max_concurency"),
        ("up: [1, 2\n", "not valid YAML"),
    ],
)
def test_a_bad_config_is_a_message_and_exit_code_2(tmp_path: Path, config: str | None, message: str) -> None:
    path = tmp_path / "up.yaml"
    if config is not None:
        path.write_text(config)
    out = up(tmp_path, "--config", str(path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything started
