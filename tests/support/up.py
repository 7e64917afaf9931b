"""`jetrl up` as the end-to-end tests run it: a run of its own under a test directory, its
processes, its recorded trajectories, its progress lines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from schemas.subjects import TRAJECTORIES_STREAM, Subjects
from services.common.bus import connect
from services.runs import run_auth, run_nats

ROOT = Path(__file__).resolve().parents[2]
ETA = 4


def up_env(*pythonpath: str) -> dict[str, str]:
    """The environment `jetrl up` runs in, as a user's shell: the test process's without its own
    service settings (`JETRL_<SERVICE>__...`, e.g. conftest's trainer issuer key, which would clash with
    the key `jetrl up` makes for its run)."""
    env = {k: v for k, v in os.environ.items() if not (k.startswith("JETRL_") and "__" in k)}
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), *pythonpath])}


def start_up(tmp_path: Path, run: str, steps: int | None, config: dict[str, Any],
             extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`jetrl up` on a run of its own under `tmp_path`; `steps` None: its default step budget;
    `extra_env`: set in the user's shell besides."""
    import yaml

    cfg = tmp_path / "up.yaml"
    cfg.write_text(yaml.safe_dump(config))
    env = up_env() | (extra_env or {})
    budget = [] if steps is None else [f"total_steps={steps}"]
    return subprocess.Popen(
        [sys.executable, "-m", "services.up", "--config", str(cfg), f"run={run}", f"run_dir={tmp_path}",
         *budget, "display=lines", "model_path=" + str(tmp_path / "model")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Every live process of runs under `run_dir` (jetrl up marks them, children included, with JETRL_RUN_DIR)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            env = proc.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if env.get("JETRL_RUN_DIR", "").startswith(str(run_dir)):
            found.append(proc)
    return found


def left_behind(run_dir: Path, grace_s: float = 15.0) -> list[psutil.Process]:
    """The processes of runs under `run_dir` still alive `grace_s` after the run ended, waiting on their
    exit: torch's `torch_shm_manager` (a daemon torch starts for shared tensors, not `jetrl up`'s
    child) exits on its own once its last client has gone, which on a loaded machine can be a moment
    after `jetrl up` returns."""
    _, alive = psutil.wait_procs(processes_of(run_dir), timeout=grace_s)
    return alive


async def read_recording(run_dir: Path, run: str) -> list[tuple[dict[str, str], bytes]]:
    with run_nats(run_dir) as url:
        # the whole recording: the run's admin user (`jetrl up` locks its bus; replay and export run as it)
        nc = await connect(url, "e2e-check", connect_timeout_s=10, auth=run_auth(run_dir, "admin"))
        js = nc.jetstream()
        last = (await js.stream_info(TRAJECTORIES_STREAM)).state.last_seq
        sub = await js.subscribe(Subjects(run).trajectories, ordered_consumer=True, stream=TRAJECTORIES_STREAM)
        out = []
        while True:
            try:
                msg = await sub.next_msg(timeout=3)
            except Exception:
                break
            out.append((msg.headers or {}, msg.data))
            if msg.metadata.sequence.stream >= last:
                break
        await nc.close()
        return out


def step_of(line: str) -> int:
    """The trainer step of a `jetrl up` progress line ("step 12/150 ..."), else -1."""
    if not line.startswith("step "):
        return -1
    return int(line.split()[1].split("/")[0])


def finish(proc: subprocess.Popen[str], timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"jetrl up did not finish within {timeout}s:\n{out[-4000:]}")
    return out


# The short runs of the fault tests: a fixed eta and batch (they count steps x 16 trained prompts).
# Two rollout workers (not the default: the kill test kills one and the run must go on with the other).
DEMO = {"up": {"rollout_workers": 2}, "trainer": {"eta": ETA, "batch_groups": 16, "checkpoint_every": 0},
        "rollout": {"ack_wait_s": 15}}
