"""A fresh trainer on a run name whose earlier trainer announced weight version N continues the
numbering: it publishes its base weights (`model_path`) as N+1, asks its prompts for N+1 or newer,
never trains a group generated with the earlier run's weights (counted as stale with its cause, shown
by `jetrl status`), counts its step budget from N+1, and a resume keeps all of that."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from schemas.subjects import Subjects
from services.common.bus import connect
from services.status.groups import render_groups, trainer_groups
from services.trainer.loop import Trainer
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from services.weights.sender.publisher import WeightPublisher, latest_published
from services.weights.sender.sync import DiskWeights
from tests.support.trainer import make_group, publish_group, take_prompts, trained_steps, write_dataset

RUN = "again2"
S = Subjects(RUN)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.timeout(300)
async def test_a_fresh_start_after_version_n_starts_at_n_plus_1_and_trains_nothing_of_the_earlier_run(
    nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    dataset = write_dataset(tmp_path / "d.jsonl", 40)
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    publisher = WeightPublisher(nc, RUN, shared_dir=tmp_path / "shared")
    publish = functools.partial(publisher.publish_dir, consume=True)  # as `jetrl trainer` passes it

    def settings(name: str, **extra: object) -> TrainerSettings:
        return TrainerSettings(
            run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / name), batch_groups=2,
            eta=100, checkpoint_every=0, fetch_timeout_s=0.2, feeder={"dataset_path": str(dataset), "max_in_flight": 4},
            **extra,
        )

    # the earlier run: one step, version 1 announced
    first = Trainer(settings("first"), TrainEngine(settings("first")), weights=DiskWeights(publish))
    try:
        await first.start(nc)
        assert first.feeder is not None and await first.feeder.feed_once() == 4
        for t in await take_prompts(js, S.prompts_train, S.rollout_consumer, 2):
            await publish_group(js, RUN, t.prompt_id, make_group(tiny_model, t.data["answer"]))
        assert await first.step() is not None and first.version == 1
    finally:
        await first.close()

    model_sha = _sha256(tiny_model / "model.safetensors")
    second = Trainer(settings("second", total_steps=1), TrainEngine(settings("second", total_steps=1)), weights=DiskWeights(publish))
    try:
        with capture_logs() as logs:
            await second.start(nc)
        said = [e for e in logs if e["event"].startswith(f"run {RUN} was used before: last announced version 1; starting at 2")]
        assert said and said[0]["log_level"] == "warning", [e["event"] for e in logs]

        # its base weights are announced as version 2, byte for byte the model it started from (which is
        # still there: the published files are links or copies, never the model's own)
        announced = await latest_published(nc, RUN)
        assert announced is not None and (announced.version, announced.step) == (2, 0)
        assert {f.name: f.sha256 for f in announced.files}["model.safetensors"] == model_sha
        assert _sha256(tiny_model / "model.safetensors") == model_sha
        assert second.version == 2 and not second.done

        assert second.feeder is not None and await second.feeder.feed_once() == 4
        new = await take_prompts(js, S.prompts_train, S.rollout_consumer, 4)
        assert {(t.issued_version, t.min_version) for t in new} == {(2, 2)}  # nothing asks for the old weights

        # an answer generated with the earlier run's weights (version 1): not trained, its row re-issued
        await publish_group(js, RUN, new[0].prompt_id, make_group(tiny_model, new[0].data["answer"], version=1))
        for t in new[1:3]:
            await publish_group(js, RUN, t.prompt_id, make_group(tiny_model, t.data["answer"], version=2, seed=1))
        values = await second.step()
        assert values is not None and values["stale_groups"] == 1 and values["total_stale_earlier_run"] == 1
        assert second.version == 3 and second.done  # total_steps=1 counts from version 2
        assert values["feeder_bound"] == (100 + 1 + 1) * 2  # admission counts the steps since version 2: one
        assert second.feeder.ledger.counters.stale == 1 and second.feeder.ledger.counters.dropped == 0
        assert [t.prompt_id for t in new[1:3]] == trained_steps(tmp_path / "second")[0]["prompt_ids"]

        status = await trainer_groups(nc, RUN, 5.0)
        assert status.outcomes["stale"] == 1 and status.stale == {"earlier_run": 1}, render_groups(status)
        assert "stale by cause: earlier_run 1" in render_groups(status)
        await second.checkpoint()
    finally:
        await second.close()

    # a resume keeps the numbering and the floor
    third = Trainer(settings("second", total_steps=2, resume="auto"), TrainEngine(settings("second", total_steps=2)),
                    weights=DiskWeights(publish))
    try:
        await third.start(nc)
        assert third.resumed and third.version == 3 and not third.done
        assert third.window.first_version == 2  # the one window the intake and the feeder read
        assert third.feeder is not None and third.feeder.ledger.window is third.window is third.intake.window
    finally:
        await third.close()
        await nc.close()
