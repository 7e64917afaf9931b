"""`jetrl status` shows what became of the dataset's rows: a real trainer (DeepSpeed, its feeder
running as in the service) against a real nats-server gets a stale group (re-issued, not charged) and
a rejection that drops its row; `jetrl status`, run as a process, reports both from the trainer's
metrics on the METRICS stream."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.subjects import Subjects
from services.common.bus import connect
from services.trainer.loop import Trainer
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from tests.support.trainer import make_group, publish_group, publish_rejection, take_prompts, write_dataset

RUN = "stf"
S = Subjects(RUN)
ROOT = Path(__file__).resolve().parents[2]


def jetrl_status(nats_url: str, fmt: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "services.status", f"run={RUN}", f"nats_url={nats_url}", f"format={fmt}", "log_format=json"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.timeout(180)
async def test_status_shows_stale_reissues_and_dropped_rows_by_cause(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    settings = TrainerSettings(
        run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), batch_groups=1, eta=0,
        checkpoint_every=0, weights={"transport": "none"}, fetch_timeout_s=0.2,
        feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 10)), "max_in_flight": 1, "max_attempts": 1},
    )
    nc = await connect(nats_url, "test")
    trainer = Trainer(settings, TrainEngine(settings))
    stopping = asyncio.Event()
    try:
        await trainer.start(nc)
        js = nc.jetstream()
        feeding = asyncio.create_task(trainer.feeder.feed_forever(stopping))

        async def next_prompt() -> str:
            [task] = await take_prompts(js, S.prompts_train, S.rollout_consumer, 1)
            return task.prompt_id

        first = await next_prompt()
        await publish_group(js, RUN, first, make_group(tiny_model, "123", version=0))
        assert await trainer.step() is not None and trainer.version == 1
        # generated with v0, judged at v1 with eta 0: stale; its row comes back uncharged (max_attempts 1)
        step = asyncio.create_task(trainer.step())  # judges each answer as it comes
        stale = await next_prompt()
        await publish_group(js, RUN, stale, make_group(tiny_model, "123", version=0))
        retry = await next_prompt()
        assert retry == stale.split(".")[0] + "-r1"
        await publish_rejection(js, RUN, retry)  # a genuine failure: the row's first and last
        trained = await next_prompt()
        await publish_group(js, RUN, trained, make_group(tiny_model, "123", version=1))
        assert await asyncio.wait_for(step, timeout=60) is not None and trainer.version == 2

        report = json.loads(jetrl_status(nats_url, "json"))["feeder"]
        assert report["reported"] and report["step"] == 2
        assert report["stale"] == 1 and report["reissued"] == 1 and report["accepted"] == 2
        assert report["dropped"] == 1 and report["dropped_by_cause"]["rejected"] == 1
        text = jetrl_status(nats_url, "table")
        assert "stale groups 1" in text and "dropped rows: 1 (rejected 1)" in text, text
    finally:
        stopping.set()
        await trainer.close()
        await nc.close()
    await asyncio.wait_for(feeding, timeout=10)
