"""A real service process configured by environment variables alone, as in a container: it starts
before NATS exists, is alive but not ready, becomes ready once NATS comes up (no start order needed),
serves its metrics as Prometheus text on the side port, and drains on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from services.bus.nats_server import NatsServer, free_port
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def poll(what: str, check: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0) -> None:
    wait_until(what, check, timeout_s=timeout_s, proc=proc, log=log, interval_s=0.1, ignore=(httpx.HTTPError,))


async def reward_answers(url: str) -> bool:
    """The readiness check a caller of the reward service registers: a responder answers."""
    import nats

    from services.common.health import nats_responder_check

    nc = await nats.connect(url)
    try:
        return await nats_responder_check(nc, "$SRV.PING.jetrl-reward")()
    finally:
        await nc.close()


def test_service_side_port_waits_for_nats_then_reports_ready_and_metrics(tmp_path: Path) -> None:
    nats_port, side_port = free_port(), free_port()
    side = f"http://127.0.0.1:{side_port}"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "JETRL_REWARD__RUN": "sideport",
        "JETRL_REWARD__NATS_URL": f"nats://127.0.0.1:{nats_port}",
        "JETRL_REWARD__HEALTH_PORT": str(side_port),
        "JETRL_REWARD__PROCESSES": "1",
        "JETRL_REWARD__METRICS_INTERVAL_S": "0.2",
        "JETRL_REWARD__LOG_FORMAT": "json",
    }
    log = tmp_path / "reward.log"
    nats = NatsServer(tmp_path / "nats", port=nats_port)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with httpx.Client(base_url=side, timeout=2.0) as client:
            poll("/healthz", lambda: client.get("/healthz").status_code == 200, proc, log)
            # NATS is not there yet: alive, not ready, and the answer says why
            resp = client.get("/readyz")
            assert resp.status_code == 503
            checks = resp.json()["checks"]
            assert any(name.startswith("nats:") and not c["ok"] for name, c in checks.items()), checks

            nats.start()
            poll("/readyz 200 after NATS started", lambda: client.get("/readyz").status_code == 200, proc, log)

            def has_metrics() -> bool:
                text = client.get("/metrics").text
                return any(line.startswith("jetrl_") and 'service="reward"' in line for line in text.splitlines())

            poll("reward metrics on /metrics", has_metrics, proc, log)
        assert asyncio.run(reward_answers(nats.url)), "the reward service did not answer $SRV.PING"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        nats.stop()
