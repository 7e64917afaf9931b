"""The image scripts share a cache between runs on one machine (~/.cache/jetrl): two test runs side by
side both build the debootstrap base, and they once moved each other's half-written tarball away
("mv: cannot stat base-bookworm.tar.tmp"). Run here with stand-ins for debootstrap, chroot and podman
on PATH (the real ones take minutes and root; the containers test runs them): the second run waits for
the first and reuses its tarball."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.unit.test_infra_static import INFRA

STAND_INS = {
    # debootstrap VARIANT INCLUDE SUITE ROOT MIRROR: a root file system, slowly, counted
    "debootstrap": 'echo run >> "$COUNT"; sleep 1; mkdir -p "${@: -2:1}/usr"; echo os > "${@: -2:1}/usr/os-release"',
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
    cache = tmp_path / "cache"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "COUNT": str(tmp_path / "count"),
           "IMPORTED": str(tmp_path / "imported"), "JETRL_CACHE": str(cache)}
    runs = [subprocess.Popen([str(INFRA / "scripts" / "make-base.sh")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    results = [(p.wait(timeout=60), p.stdout.read() if p.stdout else "", p.stderr.read() if p.stderr else "") for p in runs]
    for code, out, err in results:
        assert code == 0, err
        assert out.strip() == "localhost/jetrl-base:bookworm"
    assert (tmp_path / "count").read_text().splitlines() == ["run"]  # built once; the other waited and reused it
    tarball = cache / "base-bookworm.tar"
    assert tarball.stat().st_size > 0
    assert subprocess.run(["tar", "-tf", str(tarball)], capture_output=True, text=True, check=True).stdout.count("os-release") == 1
    assert sorted(p.name for p in cache.iterdir()) == [".make-base.lock", "base-bookworm.tar"]  # no half-written leftovers
