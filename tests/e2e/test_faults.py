"""`jetrl up` under a fault injected from outside: a 60 s nats-server outage in a live run. The run
must finish its steps, drop no dataset row and train no prompt twice (counted from what the run
recorded: the trainer's per-step prompt ids and the TRAJECTORIES stream)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import psutil

from schemas.headers import is_rejection
from schemas.trajectory import decode_group
from tests.support.up import DEMO, finish, read_recording, start_up, step_of
from tests.support.waiting import wait_until

OUTAGE_S = 60


def nats_server_of(run_dir: Path) -> psutil.Process:
    conf = str(run_dir / "nats" / "nats-server.conf")
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if conf in (proc.info["cmdline"] or []):
            return proc
    raise AssertionError(f"no nats-server running with {conf}")


def test_up_rides_out_a_60s_nats_server_outage(tmp_path: Path) -> None:
    steps = 24
    proc = start_up(tmp_path, "e2e-outage", steps, DEMO)
    run_dir = tmp_path / "e2e-outage"
    restarted: subprocess.Popen[bytes] | None = None
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line)
            if restarted is None and step_of(line) >= 6:
                server = nats_server_of(run_dir)
                cmdline = server.cmdline()
                server.kill()
                # the zombie stays until `jetrl up` reaps it; dead is enough (its port is free)
                wait_until("the killed nats-server to be gone", lambda s=server: _dead(s), timeout_s=10)
                time.sleep(OUTAGE_S)  # the fault itself: the bus stays away this long
                restarted = subprocess.Popen(cmdline, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out = "".join(lines) + finish(proc, timeout=900)
        assert restarted is not None, out[-3000:]
        assert proc.returncode == 0, out[-4000:]
        assert f"step {steps}/{steps}" in out
    finally:
        if restarted is not None:
            restarted.terminate()
            restarted.wait(30)

    # nothing trained twice: the trainer's own record of each step's prompt ids
    trained = [pid for row in map(json.loads, (run_dir / "trainer" / "steps.jsonl").read_text().splitlines())
               for pid in row.get("prompt_ids", [])]
    assert len(trained) == steps * 16
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    # every trained prompt's result is in the recording, once
    recording = asyncio.run(read_recording(run_dir, "e2e-outage"))
    recorded = [decode_group(d).meta.prompt_id for h, d in recording if not is_rejection(h)]
    assert len(recorded) == len(set(recorded))
    assert set(trained) <= set(recorded)
    # no dataset row given up on, no group lost: the trainer's own counters at its last step
    last = json.loads((run_dir / "metrics.json").read_text())["steps"][-1]
    assert last["feeder_dropped"] == 0, {k: v for k, v in last.items() if k.startswith("feeder_")}


def _dead(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
