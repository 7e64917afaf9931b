"""`jetrl trainer` on a fresh start issues its first prompts while DeepSpeed is still initialising
(the rollout workers generate the first batch meanwhile), then trains once the engine is there. The
engine's build is held here until the first prompt is on the bus: before, the trainer issued nothing
until its engine was built, so the prompt never came."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from schemas.messages import PromptTask
from schemas.subjects import Subjects
from services.common.bus import Bus, connect, declare_streams
from services.trainer import service
from services.trainer.settings import TrainerSettings
from tests.support.trainer import make_group, publish_group, take_prompts, trained_steps, write_dataset

RUN = "early"


@pytest.mark.timeout(240)
async def test_the_first_prompts_go_out_while_the_engine_is_built(
    nats_url: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = TrainerSettings(
        run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), batch_groups=2,
        eta=1, total_steps=1, checkpoint_every=0, weights={"transport": "none"}, fetch_timeout_s=0.2,
        feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 16)), "max_in_flight": 2},
    )
    release = asyncio.Event()
    built = asyncio.Event()
    real_build = service._build_engine

    async def held_build(s: TrainerSettings) -> Any:
        await release.wait()
        engine = await real_build(s)
        built.set()
        return engine

    monkeypatch.setattr(service, "_build_engine", held_build)
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await declare_streams(js)  # the rollout side may ask for prompts before the trainer is up
    trainer = asyncio.create_task(service.run_ranks(settings, functools.partial(service._run_rank0, bus=Bus.of(settings)), early=True))
    try:
        S = Subjects(RUN)
        tasks: list[PromptTask] = []
        for _ in range(20):  # the prompts, while the engine's build is held
            assert not trainer.done(), trainer.exception() if trainer.done() else None
            try:
                tasks += await take_prompts(js, S.prompts_train, S.rollout_consumer, 2 - len(tasks))
            except nats.errors.TimeoutError:
                continue
            if len(tasks) == 2:
                break
        assert len(tasks) == 2 and not built.is_set()
        for t in tasks:
            await publish_group(js, RUN, t.prompt_id, make_group(tiny_model, t.data["answer"]))
        release.set()
        await asyncio.wait_for(trainer, 180)
    finally:
        release.set()
        await nc.close()
    steps = trained_steps(settings.output_dir)
    assert [s["version"] for s in steps] == [1]
    assert sorted(steps[0]["prompt_ids"]) == sorted(t.prompt_id for t in tasks)
