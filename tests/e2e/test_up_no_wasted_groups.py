"""No wasted groups: `jetrl up` at eta=0 (two simulated inference servers with their weights agents,
two rollout workers, the DeepSpeed trainer) generates almost no group the trainer refuses as stale,
even when one weights agent stalls for a while mid-run (as after a short bus outage): prompts wait
for their weights instead of being generated on old ones, and no dataset row is dropped."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.up import finish, start_up, step_of

STEPS = 14
STALL_AT_STEP = 4
STALL_S = 6.0
"""How long the weights agent of inference-0 is stopped: many rollout rounds of the simulated
servers, so groups generated on old weights (the old behaviour) would come back stale again and again."""

CONFIG = {
    "up": {"inference_servers": 2},  # a prompt must wait for every server its worker may use
    "inference": {"simulate": True, "sim": {"token_latency_s": 0.002, "median_new_tokens": 4, "length_sigma": 1.0}},
    "rollout": {"max_new_tokens": 16, "ack_wait_s": 15},
    "trainer": {"eta": 0, "checkpoint_every": 0, "feeder": {"max_attempts": 3}},
}


@pytest.mark.timeout(900)
def test_eta0_wastes_under_2_percent_and_drops_no_row_when_an_agent_stalls(tmp_path: Path) -> None:
    proc = start_up(tmp_path, "nowaste", STEPS, CONFIG)
    run_dir = tmp_path / "nowaste"
    lines: list[str] = []
    stalled = False
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if not stalled and step_of(line) >= STALL_AT_STEP:
            stalled = True
            agent = json.loads((run_dir / "procs.json").read_text())["weights-0"]
            os.kill(agent, signal.SIGSTOP)  # the agent hears no announcement meanwhile
            try:
                time.sleep(STALL_S)
            finally:
                os.kill(agent, signal.SIGCONT)
    out = "".join(lines) + finish(proc, timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert stalled, out[-3000:]

    history = json.loads((run_dir / "metrics.json").read_text())["steps"]
    assert history[-1]["step"] == STEPS
    trained = sum(s["groups"] for s in history)
    stale = sum(s["stale_groups"] for s in history)
    assert stale < 0.02 * trained, f"{stale:.0f} stale groups for {trained:.0f} trained"
    last = history[-1]
    assert last["feeder_dropped"] == 0, {k: v for k, v in last.items() if k.startswith("feeder_")}
    # the run summary says what was wasted
    assert "stale groups" in out and "wasted samples" in out, out[-2000:]
