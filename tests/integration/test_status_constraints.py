"""Structured output's losses are visible: a rollout worker's metrics carry how many constrained
generations its engine restarted after an abort and how many agent replies missed their constraint
(the agent proxy's 422s); `jetrl status` (run as a process, against a real nats-server) shows both per
worker, and `jetrl up`'s live display among the rollout failures. The counts are set on the real engine
and proxy objects here; how they count is tested where they are made (test_agent_constrained.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import nats
from rich.console import Console
from transformers import AutoTokenizer

from schemas import metric_names as names
from services.common.bus import declare_streams
from services.common.metrics import MetricsPublisher
from services.rollout.agent.proxy import AgentProxy
from services.rollout.agent.workflow import AgentWorkflow
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import SGLangClient
from services.rollout.versions import CheckedWorkflow
from services.rollout.worker import RolloutWorker
from services.rollout.worker_config import WorkerConfig
from services.rollout.workflow import GroupedRolloutWorkflow
from services.up.display import Display
from services.up.monitor import RunView, watch
from services.up.settings import UpSettings
from services.up.stack import Stack

RUN = "constraints"
ROOT = Path(__file__).resolve().parents[2]


class Agent:
    async def run(self, data: dict, **_: object) -> float:
        return 0.0


def jetrl_status(nats_url: str, fmt: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "services.status", f"run={RUN}", f"nats_url={nats_url}", f"format={fmt}", "log_format=json"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


async def test_constraint_counters_reach_jetrl_status_and_ups_display(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    nc = await nats.connect(nats_url)
    engine = SGLangClient(InferenceClientSettings(servers=["http://127.0.0.1:1"]))
    try:
        await declare_streams(nc.jetstream())
        view = RunView()
        subs = await watch(nc, RUN, view)  # what `jetrl up` watches
        workflow = AgentWorkflow(Agent())
        workflow.proxy = AgentProxy(engine, AutoTokenizer.from_pretrained(tiny_model))
        engine.constrained_restarts, workflow.proxy.stats.unmet = 2, 1
        wrapped = GroupedRolloutWorkflow(CheckedWorkflow(workflow), 2)  # as the rollout service wraps it
        worker = RolloutWorker(nc, RUN, wrapped, engine, WorkerConfig(worker="w0"), metrics=MetricsPublisher(nc, RUN, "rollout", "w0"))
        await worker.metrics.emit(worker._snapshot())  # type: ignore[union-attr]  # the worker's periodic report
        await nc.flush()
        for _ in range(200):  # the display's subscription gets it (a real round trip through nats-server)
            if "rollout/w0" in view.latest:
                break
            await asyncio.sleep(0.01)

        [w0] = [w for w in json.loads(jetrl_status(nats_url, "json"))["bus"]["workers"] if w["service"] == "rollout"]
        assert w0["counters"] == {names.CONSTRAINED_RESTARTS_TOTAL: 2.0, names.CONSTRAINT_UNMET_TOTAL: 1.0}
        assert "constrained restarts 2  constraint unmet 1" in jetrl_status(nats_url, "table")

        console = Console(record=True, width=200)
        console.print(Display(UpSettings(run=RUN, display="live"), view, Stack(tmp_path, {}))._table())
        assert "rollout failures" in (text := console.export_text()) and "constrained restarts 2 constraint unmet 1" in text, text
        for sub in subs:
            await sub.unsubscribe()
    finally:
        await engine.aclose()
        await nc.close()
