"""The image scripts share a cache between runs on one machine (~/.cache/jetrl): two test runs side by
side both build the debootstrap base, and they once moved each other's half-written tarball away
("mv: cannot stat base-bookworm.tar.tmp"). Run here with stand-ins for debootstrap, chroot and podman
on PATH (the real ones take minutes and root; the containers test runs them): the second run waits for
the first and reuses its tarball. The first run's build is held open until the second has either
reached the lock or started a build of its own, so the two always overlap, however loaded the machine."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.unit.test_infra_static import INFRA

STAND_INS = {
    # debootstrap VARIANT INCLUDE SUITE ROOT MIRROR: a root file system, counted, held until the test releases it
    "debootstrap": ('echo run >> "$COUNT"; for _ in $(seq 600); do [ -f "$RELEASE" ] && break; sleep 0.05; done; '
                    'mkdir -p "${@: -2:1}/usr"; echo os > "${@: -2:1}/usr/os-release"'),
    "chroot": "true",
    "podman": 'if [ "$1 $2" = "image exists" ]; then [ -f "$IMPORTED" ]; else touch "$IMPORTED"; fi',
}


@pytest.mark.skipif(not Path("/usr/bin/flock").exists() and not Path("/bin/flock").exists(), reason="no flock(1)")
def test_two_runs_side_by_side_build_the_base_once_and_both_get_it(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    cache, count, release = tmp_path / "cache", tmp_path / "count", tmp_path / "release"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "COUNT": str(count), "IMPORTED": str(tmp_path / "imported"),
           "RELEASE": str(release), "JETRL_CACHE": str(cache)}

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen([str(INFRA / "scripts" / "make-base.sh")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    runs = [start()]
    try:
        _until(count.exists, "the first run's build to start")
        runs.append(start())
        # the second waits on the lock (flock is its command line) or, unlocked, builds too (a second "run")
        _until(lambda: _command(runs[1].pid).startswith("flock") or count.read_text().count("run") == 2,
               "the second run to reach the lock or a build")
    finally:
        release.touch()  # the first run's build ends
    results = [(p.wait(timeout=60), p.stdout.read() if p.stdout else "", p.stderr.read() if p.stderr else "") for p in runs]
    for code, out, err in results:
        assert code == 0, err
        assert out.strip() == "localhost/jetrl-base:bookworm"
    assert count.read_text().splitlines() == ["run"]  # built once; the other waited and reused it
    tarball = cache / "base-bookworm.tar"
    assert tarball.stat().st_size > 0
    assert subprocess.run(["tar", "-tf", str(tarball)], capture_output=True, text=True, check=True).stdout.count("os-release") == 1
    assert sorted(p.name for p in cache.iterdir()) == [".make-base.lock", "base-bookworm.tar"]  # no half-written leftovers


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def _until(done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)  # polling a process's state and a file, not waiting blindly
