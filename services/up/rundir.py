"""The run directory of `jetrl up`: always a fresh one.

`jetrl up` has no resume: a run directory left by an earlier run of the same name holds its NATS store
(old trajectories, queued prompts, the last published weights, which a new weights agent would load at
once). So an existing, non-empty `<run_dir>/<run>` is moved aside to `<run>.<YYYYmmdd-HHMMSS>` (the
time of its last change) - kept for `jetrl status` / `plot` / `replay`, out of the new run's way. A
directory holding only empty directories (a filesystem mounted for the store at `<run>/nats`, docs/security.md
"A full disk") holds nothing of a run: it is used as it is.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from services.common.logging import get_logger
from services.runs import URL_FILE

log = get_logger("up")


class RunDirInUse(RuntimeError):
    """The run directory belongs to a `jetrl up` that is still running."""


def prepare_run_dir(root: Path, run: str) -> tuple[Path, Path | None]:
    """Return (the empty run directory, where a previous run's directory was moved or None)."""
    run_dir = root.resolve() / run
    kept = None
    if run_dir.is_dir() and any(p.is_file() or p.is_symlink() or any(p.iterdir()) for p in run_dir.iterdir()):
        _refuse_if_live(run_dir, run)
        kept = _unused(root.resolve() / f"{run}.{time.strftime('%Y%m%d-%H%M%S', time.localtime(last_change(run_dir)))}")
        run_dir.rename(kept)
        log.warning("run directory was in use: the previous run is kept aside, this run starts fresh", run=run, kept=str(kept))
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, kept


def last_change(path: Path) -> float:
    """The newest modification time of `path` and everything under it (a file written inside a
    subdirectory does not change the directories' own times)."""
    newest = path.stat().st_mtime
    for top, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            try:
                newest = max(newest, os.lstat(os.path.join(top, name)).st_mtime)
            except OSError:  # removed meanwhile
                continue
    return newest


def _unused(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _refuse_if_live(run_dir: Path, run: str) -> None:
    """A live run's NATS server answers at the URL it wrote; a crashed one left the file behind."""
    url_file = run_dir / URL_FILE
    if not url_file.exists():
        return
    url = urlsplit(url_file.read_text().strip())
    if not url.hostname or not url.port:
        return
    try:
        with socket.create_connection((url.hostname, url.port), timeout=1.0):
            pass
    except OSError:
        return  # nobody there: left by a run that did not end cleanly
    raise RunDirInUse(
        f"run {run!r} is still running ({run_dir}, NATS at {url.geturl()}): stop it first or pick another name with run=NAME"
    )
