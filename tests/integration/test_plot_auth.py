"""`jetrl plot` against a bus with per-service users: `--nats-auth` logs in as the read-only
`observer` and the run's curves are redrawn, the workflow's own `stats_tracker` scalars (a rollout
worker's METRICS values, `<scope>/<name>`) in a picture of their own; without credentials the server's refusal is named; a
setting that does not exist is named before anything connects."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from schemas.messages import MetricsEvent, encode
from schemas.subjects import METRICS_STREAM, Subjects
from services.bus.nats_server import NatsServer
from services.bus.permissions import authorization_block
from services.common.bus import connect, publish_acked
from services.common.nats_auth import NatsAuth
from tests.support.bus_users import ROOT, bus_init, write_secrets

RUN = "plotted"


def plot(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "plot", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


async def trainer_steps(url: str, password_file: str, n: int) -> None:
    """`n` trainer step events, published as the trainer user (what its metrics look like on the bus)."""
    nc = await connect(url, "steps", auth=NatsAuth(user="trainer", password_file=password_file))
    try:
        for step in range(1, n + 1):
            event = MetricsEvent(run=RUN, service="trainer", step=step, version=step, values={"reward_mean": step / n})
            await publish_acked(nc.jetstream(), Subjects(RUN).metrics("trainer"), encode(event), timeout_s=10,
                                stream=METRICS_STREAM)
    finally:
        await nc.close()


async def workflow_stats(url: str, password_file: str, n: int) -> None:
    """`n` rollout metrics events carrying a workflow's scalars, as the rollout user publishes them."""
    nc = await connect(url, "rollout", auth=NatsAuth(user="rollout", password_file=password_file))
    try:
        for i in range(n):
            event = MetricsEvent(run=RUN, service="rollout", worker="w0",
                                 values={"accepted_total": float(i), "rollout/reward": i / n, "rollout/num_turns": 1.0 + i % 2})
            await publish_acked(nc.jetstream(), Subjects(RUN).metrics("rollout"), encode(event), timeout_s=10,
                                stream=METRICS_STREAM)
    finally:
        await nc.close()


def test_plot_reads_a_secured_bus_as_the_observer(tmp_path: Path) -> None:
    passwords, files = write_secrets(tmp_path / "secrets")
    server = NatsServer(tmp_path / "nats", extra_conf=authorization_block(RUN, passwords)).start()
    try:
        assert bus_init(server.url, files).returncode == 0
        asyncio.run(trainer_steps(server.url, files["trainer"], 5))
        asyncio.run(workflow_stats(server.url, files["rollout"], 4))
        run_dir = tmp_path / RUN
        run_dir.mkdir()
        out = tmp_path / "out"
        drawn = plot(str(run_dir), "--nats-url", server.url, "--out", str(out),
                     "--nats-auth", "user=observer", "--nats-auth", f"password_file={files['observer']}")
        assert drawn.returncode == 0, drawn.stderr[-2000:]
        steps = json.loads((out / "metrics.json").read_text())["steps"]
        assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
        assert (out / "reward_curve.png").stat().st_size > 0
        stats = json.loads((out / "metrics.json").read_text())["workflow_stats"]
        assert [s["rollout/reward"] for s in stats] == [0.0, 0.25, 0.5, 0.75]
        assert f"workflow statistics: {out / 'workflow_stats.png'}" in drawn.stdout, drawn.stdout
        assert "workflow statistics (mean of the last 10 reports): rollout/num_turns 1.5, rollout/reward 0.375" in drawn.stdout
        assert (out / "workflow_stats.png").stat().st_size > 10_000

        refused = plot(str(run_dir), "--nats-url", server.url, "--out", str(out))
        assert refused.returncode == 1
        assert "authorization violation" in refused.stderr.lower() and "--nats-auth" in refused.stderr, refused.stderr[-2000:]
        assert "Traceback" not in refused.stderr

        typo = plot(str(run_dir), "--nats-url", server.url, "--nats-auth", "username=observer")
        assert typo.returncode == 2
        assert "--nats-auth 'username=observer'" in typo.stderr and "user, password" in typo.stderr
    finally:
        server.stop()
