"""A full disk under `jetrl up`'s store is an alert, and the run finishes once space returns.

The store of a real run is put on a 48 MB tmpfs mounted at `<run>/nats`; once the run trains, the
test fills that filesystem. What a user sees is asserted: within 10 s `jetrl up` logs an error naming
the stream and its display says STORE FULL with the stream; `jetrl status` names it too. Then the
filesystem grows (`mount -o remount,size=...`, as an operator makes room), nats-server is restarted by
`up` (it keeps failing a stream's block after a write error until it restarts) and the run finishes.
Mounting needs root (or CAP_SYS_ADMIN): elsewhere the test is skipped, saying so. The same run has a
prompt issuer key of the user's in its environment, which `up` takes as the run's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from schemas.subjects import stream_specs
from services.bus.permissions import OBJ_STREAM
from tests.support.up import DEMO, ROOT, start_up, step_of

RUN = "full"
ETA = 1
STEPS = 30
"""Far more than the groups recorded before the store fills can train (the feeder issues prompts up to
`eta` + 1 steps ahead), so the run cannot finish before space returns. The test fills the store once it
reads a step line; on a quiet machine (~0.1 s a step) the run is a few steps further by then, and a run
of 3 + 2 * eta steps once trained its last step before the fill and ended without the store recovered."""
DETECT_S = 10.0
STREAMS = (*(spec.name for spec in stream_specs()), OBJ_STREAM)


def mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"a small filesystem for the store needs mounting a tmpfs, not permitted here: {done.stderr.strip()}")


def fill(path: Path) -> None:
    """Write into `path` until its filesystem has no space left."""
    block = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
        with contextlib.suppress(OSError):  # the last few KiB
            while f.write(b"\0" * 4096):
                pass


def reader(stream: object) -> queue.Queue[str | None]:
    """The lines of `stream` as they come, on a queue (None at its end)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def wait_for(lines: queue.Queue[str | None], seen: list[str], until: float, *wanted: str) -> list[str]:
    """Read lines until each of `wanted` is in one (returns those lines) or `until` (monotonic) passes."""
    found: dict[str, str] = {}
    while len(found) < len(wanted):
        try:
            line = lines.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            lines.put(None)  # the end stays for the next reader
            break
        seen.append(line)
        found.update({w: line for w in wanted if w in line and w not in found})
    return [found[w] for w in wanted if w in found]


@pytest.mark.timeout(600)
def test_a_full_store_is_shown_within_10s_and_the_run_finishes_after_space_returns(tmp_path: Path) -> None:
    store = tmp_path / RUN / "nats"
    mount_tmpfs(store, "48m")
    try:
        _run_to_the_end_through_a_full_store(tmp_path, store)
    finally:
        subprocess.run(["umount", "-l", str(store)], capture_output=True)


def _run_to_the_end_through_a_full_store(tmp_path: Path, store: Path) -> None:
    config = {**DEMO, "up": {"rollout_workers": 1, "store_restart_free_bytes": 100_000_000},
              "trainer": {**DEMO["trainer"], "eta": ETA}}
    started = time.monotonic()
    # besides: a prompt issuer key of the user's own in the shell, which becomes the run's (no "set one, not both")
    proc = start_up(tmp_path, RUN, STEPS, config, {"JETRL_TRAINER__TRUST__PROMPT_ISSUER_KEY": "the-users-own-key"})
    assert proc.stdout is not None
    lines, seen = reader(proc.stdout), []
    try:
        while (line := lines.get(timeout=400)) is not None and step_of(line) < 1:
            seen.append(line)
        assert line is not None, "".join(seen[-60:])

        fill(store / "filler")
        filled = time.monotonic()
        print(f"filled at {filled - started:.0f}s")
        shown = wait_for(lines, seen, filled + DETECT_S, "STORE FULL: ", '"the JetStream store is full')
        assert len(shown) == 2, f"no store-full alert within {DETECT_S}s:\n" + "".join(seen[-40:])
        print(f"shown {time.monotonic() - filled:.1f}s after filling")
        display, logged = shown
        assert any(name in display for name in STREAMS), display
        assert json.loads(logged)["level"] == "error" and json.loads(logged)["stream"] in STREAMS, logged

        status = subprocess.run([sys.executable, "-m", "services.status", f"run={RUN}", f"run_dir={tmp_path}", "format=json",
                                 "log_format=json"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                capture_output=True, text=True, timeout=120)
        full = json.loads(status.stdout)["store_full"]
        assert set(full) & set(STREAMS) and all("no space left on device" in e for e in full.values()), status.stdout[-3000:]

        # the operator makes room: the filesystem grows; up restarts nats-server and the run goes on
        subprocess.run(["mount", "-o", "remount,size=256m", str(store)], check=True)
        grown = time.monotonic()
        wait_for(lines, seen, time.monotonic() + 300, "store writable again")
        print(f"writable again {time.monotonic() - grown:.1f}s after growing")
        while (line := lines.get(timeout=300)) is not None:
            seen.append(line)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        with contextlib.suppress(queue.Empty):  # a child of up's may hold the pipe open a little longer
            while (rest := lines.get(timeout=10)) is not None:
                seen.append(rest)
        out = "".join(seen)
    assert proc.returncode == 0, out[-4000:]
    assert f"run {RUN}: finished" in out and "store writable again" in out, out[-4000:]
    assert "the trainer checks pushed prompts with your prompt issuer key" in out
    assert (tmp_path / RUN / "secrets" / "prompt-issuer-key").read_text().strip() == "the-users-own-key"
    metrics = json.loads((tmp_path / RUN / "metrics.json").read_text())
    assert metrics["steps"][-1]["step"] == STEPS
    assert metrics["store"]["times_full"] and metrics["store"]["nats_restarts"] >= 1 and not metrics["store"]["full_at_end"]
