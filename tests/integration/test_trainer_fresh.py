"""A trainer with a feeder started without a checkpoint on a run name used before on the same server:
it trains only on answers to its own prompts - not on the earlier incarnation's recording (same seed,
same row order, so the same prompt ids), not on its queued prompts, not on an answer one of its
episodes still publishes - and says what it ignored."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from schemas.subjects import PROMPTS_STREAM, Subjects
from services.common.bus import connect
from services.trainer.loop import Trainer
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from services.weights.sender.publisher import WeightPublisher
from services.weights.sender.sync import DiskWeights
from tests.support.trainer import make_group, publish_group, read_steps, take_prompts, write_dataset

RUN = "again"
S = Subjects(RUN)


async def _queued_prompts(js: object) -> int:
    info = await js.stream_info(PROMPTS_STREAM, subjects_filter=S.prompts_all)  # type: ignore[attr-defined]
    return sum((info.state.subjects or {}).values())


@pytest.mark.timeout(180)
async def test_a_fresh_start_on_a_used_run_name_trains_only_on_its_own_prompts(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "d.jsonl", 40)
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    publisher = WeightPublisher(nc, RUN, shared_dir=tmp_path / "weights")

    def settings(name: str) -> TrainerSettings:
        return TrainerSettings(
            run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / name), batch_groups=2,
            eta=100, checkpoint_every=0, fetch_timeout_s=0.2, feeder={"dataset_path": str(dataset), "max_in_flight": 6},
        )

    # the earlier incarnation: trains one step on two answers, announces version 1, leaves prompts queued
    # and one episode still running
    first = Trainer(settings("first"), TrainEngine(settings("first")), weights=DiskWeights(publisher.publish_dir))
    try:
        await first.start(nc)
        assert await first.feeder.feed_once() == 6
        old = await take_prompts(js, S.prompts_train, S.rollout_consumer, 3)
        for t in old[:2]:
            await publish_group(js, RUN, t.prompt_id, make_group(tiny_model, t.data["answer"]))
        assert await first.step() is not None and first.version == 1
    finally:
        await first.close()
    assert await _queued_prompts(js) == 3

    second = Trainer(settings("second"), TrainEngine(settings("second")))
    try:
        with capture_logs() as logs:
            await second.start(nc)
        warned = {e["event"]: e for e in logs if e["log_level"] == "warning"}
        used = next(e for k, e in warned.items() if k.startswith("run name used before"))
        assert used["recorded_trajectories_ignored"] == 2 and used["queued_prompts_dropped"] == 3
        assert next(e for k, e in warned.items() if k.startswith("weights of an earlier"))["announced_version"] == 1
        assert await _queued_prompts(js) == 0

        assert await second.feeder.feed_once() == 6
        new = await take_prompts(js, S.prompts_train, S.rollout_consumer, 6)
        assert len(new) == 6 and {t.data["id"] for t in new} >= {t.data["id"] for t in old}  # same rows again
        assert not {t.prompt_id for t in new} & {t.prompt_id for t in old}
        # the earlier incarnation's running episode answers now; then two of ours
        await publish_group(js, RUN, old[2].prompt_id, make_group(tiny_model, old[2].data["answer"], version=1))
        for t in new[:2]:
            await publish_group(js, RUN, t.prompt_id, make_group(tiny_model, t.data["answer"], seed=1))
        values = await second.step()
        assert values is not None and values["foreign_groups"] == 1
    finally:
        await second.close()
        await nc.close()

    trained = [r["prompt_ids"] for r in read_steps(tmp_path / "second") if "prompt_ids" in r]
    assert trained == [[t.prompt_id for t in new[:2]]]
