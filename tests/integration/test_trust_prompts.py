"""The trainer trains only answers to prompts it issued in this run (or a configured issuer tagged),
against a real nats-server and a real trainer: a forged group with a never-issued prompt id, a group
whose tag no key of the trainer made, and the answer to a forged prompt are each refused, counted as
`unissued_prompt` in the trainer's metrics (what `jetrl status` shows), and none costs a real prompt a
try; answers to prompts issued before a restart still check out after a resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from schemas.headers import prompt_headers, prompt_tag_of, trajectory_headers
from schemas.messages import PromptTask, decode, encode
from schemas.subjects import PROMPTS_STREAM, TRAJECTORIES_STREAM, Subjects
from schemas.trajectory import encode_group, group_to_table
from services.common.bus import connect
from services.common.signing import prompt_tag
from services.status.groups import render_groups, trainer_groups
from services.trainer.loop import Trainer
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from tests.support.trainer import make_group, until, write_dataset

RUN = "trust"


async def _pull_prompts(js: Any, n: int) -> list[tuple[PromptTask, dict[str, str]]]:
    """Act as a rollout worker: pull n prompts, keeping the headers (the tag) each came with."""
    sub = await js.pull_subscribe(Subjects(RUN).prompts_train, durable=Subjects(RUN).rollout_consumer, stream=PROMPTS_STREAM)
    msgs = await sub.fetch(n, timeout=10)
    for m in msgs:
        await m.ack()
    await sub.unsubscribe()
    return [(decode(PromptTask, m.data), dict(m.headers or {})) for m in msgs]


async def _answer(js: Any, model: Path, prompt_id: str, answer: str, tag: str, seed: int = 0) -> None:
    """A group answering `prompt_id` with the headers a rollout worker gives it (`tag` copied)."""
    tensors = make_group(model, answer, seed=seed)
    _, meta = group_to_table(tensors, run=RUN, prompt_id=prompt_id, worker="w")
    await js.publish(Subjects(RUN).trajectories, encode_group(tensors, run=RUN, prompt_id=prompt_id, worker="w"),
                     headers=trajectory_headers(meta, tag), stream=TRAJECTORIES_STREAM)


def _settings(nats_url: str, model: Path, tmp_path: Path, **extra: Any) -> TrainerSettings:
    return TrainerSettings(
        run=RUN, nats_url=nats_url, model_path=str(model), output_dir=str(tmp_path / "out"), zero_stage=2,
        batch_groups=2, eta=100, checkpoint_every=0, fetch_timeout_s=0.2, weights={"transport": "none"},
        feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 20)), "max_in_flight": 4}, **extra,
    )


@pytest.mark.timeout(150)
async def test_forged_groups_and_prompts_are_refused_and_counted(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    settings = _settings(nats_url, tiny_model, tmp_path)
    nc = await connect(nats_url, "test")
    trainer = Trainer(settings, TrainEngine(settings))
    await trainer.start(nc)
    js = nc.jetstream()
    feeder = trainer.feeder
    assert feeder is not None
    assert await feeder.feed_once() == 4
    issued = await _pull_prompts(js, 4)
    assert all(prompt_tag_of(h) for _, h in issued), "the feeder tags every prompt it issues"

    # a forged prompt, answered by an honest worker: it copies the (absent) tag
    forged = PromptTask(run=RUN, prompt_id="0-999", data={"prompt": "evil", "answer": "666"})
    await js.publish(Subjects(RUN).prompts_train, encode(forged), headers=prompt_headers(RUN, forged.prompt_id),
                     stream=PROMPTS_STREAM)
    (pulled, headers), = await _pull_prompts(js, 1)
    await _answer(js, tiny_model, pulled.prompt_id, "666", prompt_tag_of(headers))
    # a forged group for a real prompt, under a key the trainer does not hold
    real, _ = issued[0]
    await _answer(js, tiny_model, real.prompt_id, "000", prompt_tag(b"not-the-key", RUN, real.prompt_id))
    # a tag stolen from a real prompt, put on another prompt id
    await _answer(js, tiny_model, "1-998", "111", prompt_tag_of(issued[1][1]))
    # two honest answers
    for i, (task, h) in enumerate(issued[2:]):
        await _answer(js, tiny_model, task.prompt_id, task.data["answer"], prompt_tag_of(h), seed=i)

    values = await trainer.step()
    assert values is not None and trainer.version == 1
    assert values["total_terminated_unissued_prompt"] == 3
    assert values["total_accepted"] == 2
    # the refusals cost the real prompts nothing: still in flight, not charged, not re-issued
    assert feeder.ledger.counters.rejected == 0 and real.prompt_id in feeder.ledger.in_flight
    assert feeder.ledger.in_flight[real.prompt_id][2] == 0
    assert {"0-999", "1-998"}.isdisjoint(trainer.intake.trained)

    # the step's report reaches the METRICS stream on its own time (slow on a loaded machine): wait for it
    async def counted() -> bool:
        return (await trainer_groups(nc, RUN, timeout_s=5.0)).step is not None

    await until("the trainer's step report in jetrl status", counted, timeout_s=60)
    status = await trainer_groups(nc, RUN, timeout_s=5.0)
    assert status.terminated.get("unissued_prompt") == 3, render_groups(status)

    # across a restart: answers to prompts issued before it still check out. (Not issued[0]: the
    # forged group took its result's de-duplication id; that prompt is re-issued when it times out.)
    assert await feeder.feed_once() == 2
    later = await _pull_prompts(js, 2)
    await trainer.checkpoint()
    await trainer.close()
    resumed = Trainer(_settings(nats_url, tiny_model, tmp_path, resume="auto"), trainer.engine)
    await resumed.start(nc)
    assert resumed.resumed
    for i, (task, h) in enumerate([issued[1], later[0]]):
        await _answer(js, tiny_model, task.prompt_id, task.data["answer"], prompt_tag_of(h), seed=3 + i)
    values = await resumed.step()
    assert values is not None and resumed.version == 2
    assert values["total_accepted"] == 4 and values["total_terminated_unissued_prompt"] == 3
    await resumed.close()
    await nc.drain()


@pytest.mark.timeout(180)
async def test_pushed_prompts_are_trained_only_when_tagged_by_the_configured_issuer(
        nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    from services.common.settings import SettingsError
    from services.trainer.feed.prompts import push

    def settings(issuer: str) -> TrainerSettings:
        return TrainerSettings(
            run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), zero_stage=2,
            batch_groups=2, eta=100, checkpoint_every=0, fetch_timeout_s=0.2, weights={"transport": "none"},
            feeder={"enabled": False}, trust={"prompt_issuer_key": issuer},
        )

    engine = TrainEngine(settings("issuer-k"))
    with pytest.raises(SettingsError, match="prompt_issuer_key"):
        Trainer(settings(""), engine)  # no feeder, no issuer: it could trust no group
    trainer = Trainer(settings("issuer-k"), engine)
    nc = await connect(nats_url, "test")
    await trainer.start(nc)
    js = nc.jetstream()
    data = write_dataset(tmp_path / "push.jsonl", 5)
    assert await push(nats_url, RUN, str(data), limit=1, prefix="plain") == 1
    assert await push(nats_url, RUN, str(data), limit=2, prefix="signed", issuer_key=b"issuer-k") == 2
    for i, (task, headers) in enumerate(await _pull_prompts(js, 3)):
        await _answer(js, tiny_model, task.prompt_id, task.data["answer"], prompt_tag_of(headers), seed=i)
    values = await trainer.step()
    assert values is not None
    assert values["total_accepted"] == 2 and values["total_terminated_unissued_prompt"] == 1
    assert trainer.intake.trained == {"signed-0", "signed-1"}
    await trainer.close()
    await nc.drain()
