"""The trainer loop in-process (world size 1, ZeRO-2) against a real nats-server: the feeder's
admission bound, versions advancing with weights published, stale / duplicate / rejected / malformed
trajectories handled, metrics on the METRICS stream."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.numpy import load_file

from schemas.messages import MetricsEvent, PromptTask, decode
from schemas.subjects import METRICS_STREAM, TRAJECTORIES_STREAM, Subjects
from services.common.bus import connect
from services.trainer.loop import Trainer
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from services.weights.sender.sync import DiskWeights
from tests.support.trainer import (
    make_group,
    publish_group,
    publish_rejection,
    read_steps,
    take_prompts,
    write_dataset,
)

RUN = "t1"


async def _take_prompts(js, n: int) -> list[PromptTask]:
    return await take_prompts(js, Subjects(RUN).prompts_train, Subjects(RUN).rollout_consumer, n)


@pytest.mark.timeout(120)
async def test_trainer_steps_with_admission_staleness_and_duplicates(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    settings = TrainerSettings(
        run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), zero_stage=2,
        batch_groups=2, eta=1, checkpoint_every=0, fetch_timeout_s=0.2,
        feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 50)), "max_in_flight": 5},
    )
    published: list[tuple[int, Path, list[str]]] = []

    async def publish(version: int, step: int, hf_dir: Path) -> None:
        weights = load_file(hf_dir / "model.safetensors")
        published.append((version, hf_dir, sorted(weights)))

    nc = await connect(nats_url, "test")
    trainer = Trainer(settings, TrainEngine(settings), weights=DiskWeights(publish))
    await trainer.start(nc)
    js = nc.jetstream()
    assert trainer.feeder is not None
    feeder = trainer.feeder.ledger

    def check_bound() -> None:
        c = feeder.counters
        assert c.issued - c.rejected <= (settings.eta + trainer.version + 1) * settings.batch_groups
        assert c.in_flight <= feeder.max_in_flight

    # version 0: (eta + 0 + 1) * B = 4 prompts admitted, not one more
    assert await trainer.feeder.feed_once() == 4
    check_bound()
    assert await trainer.feeder.feed_once() == 0
    tasks = await _take_prompts(js, 4)
    assert len(tasks) == 4

    # step 1: one rejection marker (re-issued later), a malformed message, then two good groups
    await publish_rejection(js, RUN, tasks[0].prompt_id)
    await js.publish(Subjects(RUN).trajectories, b"not arrow", headers={"Jetrl-Prompt-Id": "garbage"}, stream=TRAJECTORIES_STREAM)
    seq_a = await publish_group(js, RUN, tasks[1].prompt_id, make_group(tiny_model, tasks[1].data["answer"]))
    await publish_group(js, RUN, tasks[2].prompt_id, make_group(tiny_model, tasks[2].data["answer"], seed=1))
    values = await trainer.step()
    assert values is not None and trainer.version == 1
    assert values["rejected_groups"] == 1 and values["malformed_groups"] == 1
    assert feeder.counters.rejected == 1 and feeder.counters.accepted == 2
    assert published[-1][0] == 1 and "model.embed_tokens.weight" in published[-1][2]

    # the rejected row comes back under a new id; bound at v=1 is 6
    await trainer.feeder.feed_once()
    check_bound()
    assert feeder.counters.issued - feeder.counters.rejected == 6 or feeder.counters.in_flight == feeder.max_in_flight
    more = await _take_prompts(js, 10)
    reissued = [t for t in more if t.prompt_id.endswith("-r1")]
    assert [t.data for t in reissued] == [tasks[0].data]

    # step 2: a duplicate of an already trained prompt (past the de-duplication window: new msg id) is skipped
    await publish_group(js, RUN, tasks[1].prompt_id, make_group(tiny_model, "000"), msg_id="replayed")
    await publish_group(js, RUN, tasks[3].prompt_id, make_group(tiny_model, tasks[3].data["answer"]))
    await publish_group(js, RUN, more[0].prompt_id, make_group(tiny_model, more[0].data["answer"]))
    values = await trainer.step()
    assert values is not None and trainer.version == 2 and values["duplicate_groups"] == 1
    assert await trainer.feeder.feed_once() == 2  # v=2: bound 8 = 9 issued - 1 rejected
    check_bound()
    more = more[1:] + await _take_prompts(js, 2)

    # step 3 at version 2, eta 1: a group made by version 0 is stale (dropped, counted, re-issued)
    stale_id = more[0].prompt_id
    await publish_group(js, RUN, stale_id, make_group(tiny_model, more[0].data["answer"], version=0))
    await publish_group(js, RUN, more[1].prompt_id, make_group(tiny_model, more[1].data["answer"], version=1))
    await publish_group(js, RUN, more[2].prompt_id, make_group(tiny_model, more[2].data["answer"], version=2))
    values = await trainer.step()
    assert values is not None and trainer.version == 3
    assert values["stale_groups"] == 1 and values["staleness_1"] == 1 and values["staleness_0"] == 1
    epoch, row = (int(x) for x in stale_id.split("-")[:2])
    # re-issued as its first re-issue, with no failure charged to the row: [epoch, row, failures, reissue]
    assert stale_id not in trainer.intake.trained and [epoch, row, 0, 1] in list(feeder.reissue)
    await trainer.feeder.feed_once()
    check_bound()

    # versions advanced by one per step, each published; the step record names what was trained
    assert [v for v, _, _ in published] == [1, 2, 3]
    steps = [r for r in read_steps(settings.output_dir) if "prompt_ids" in r]
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert steps[0]["prompt_ids"] == [tasks[1].prompt_id, tasks[2].prompt_id] and steps[0]["seqs"][0] == seq_a

    # per-step metrics are on the METRICS stream
    msub = await js.subscribe(Subjects(RUN).metrics("trainer"), stream=METRICS_STREAM, ordered_consumer=True)
    events = [decode(MetricsEvent, (await msub.next_msg(timeout=5)).data) for _ in range(3)]
    assert [e.step for e in events] == [1, 2, 3]
    for key in ("loss", "reward_mean", "grad_norm", "entropy", "clip_fraction", "tokens_per_s", "data_wait_fraction"):
        assert key in events[-1].values
    await nc.close()


async def test_prompts_cli_pushes_a_dataset_onto_the_work_queue(nats_url: str, tmp_path: Path) -> None:
    from services.trainer.feed.prompts import push

    dataset = write_dataset(tmp_path / "d.jsonl", 3)
    assert await push(nats_url, RUN, str(dataset)) == 3
    assert await push(nats_url, RUN, str(dataset)) == 3  # same ids: de-duplicated, not queued twice
    nc = await connect(nats_url, "test")
    tasks = await _take_prompts(nc.jetstream(), 10)
    assert [t.prompt_id for t in tasks] == ["push-0", "push-1", "push-2"] and tasks[0].data["prompt"].endswith("=")
    await nc.close()
