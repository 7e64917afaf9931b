"""Eval rounds against a real nats-server: the trainer issues the eval set after a step, the answers
(groups, a rejection, a duplicate, garbage) come back on `.trajectories.eval`, and one `MetricsEvent`
with service "eval" reports the round; a round nobody finishes is reported at its timeout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from schemas.headers import rejection_headers, trajectory_headers
from schemas.messages import MetricsEvent, RejectionMarker, decode, encode
from schemas.subjects import TRAJECTORIES_STREAM, Subjects
from schemas.trajectory import encode_group_with_meta
from services.common.bus import connect, declare_streams
from services.trainer.feed.evaluation import EvalRounds
from services.trainer.loop import Trainer
from services.trainer.model.engine import TrainEngine
from services.trainer.settings import TrainerSettings
from tests.support.trainer import make_group, publish_group, take_prompts, write_dataset

RUN = "ev"
S = Subjects(RUN)


async def _answer(js: Any, tiny_model: Path, prompt_id: str, rewards: list[float]) -> None:
    """Act as a rollout worker answering an eval prompt with a group of these rewards."""
    tensors = make_group(tiny_model, "123", group_size=len(rewards))
    tensors["rewards"] = np.array(rewards, dtype=np.float32)
    body, meta = encode_group_with_meta(tensors, run=RUN, prompt_id=prompt_id, worker="test", is_eval=True)
    await js.publish(S.trajectories_eval, body, headers=trajectory_headers(meta), stream=TRAJECTORIES_STREAM)


async def _reject(js: Any, prompt_id: str) -> None:
    body = encode(RejectionMarker(run=RUN, prompt_id=prompt_id, worker="test", reason="all failed", is_eval=True))
    await js.publish(S.trajectories_eval, body, headers=rejection_headers(RUN, prompt_id), stream=TRAJECTORIES_STREAM)


@pytest.mark.timeout(120)
async def test_trainer_reports_an_eval_round_once_every_prompt_is_answered(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    settings = TrainerSettings(
        run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), batch_groups=1,
        checkpoint_every=0, weights={"transport": "none"}, fetch_timeout_s=0.2,
        feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 10)), "max_in_flight": 1,
                "eval_dataset_path": str(write_dataset(tmp_path / "e.jsonl", 5)), "eval_every": 1, "eval_size": 3},
    )
    nc = await connect(nats_url, "test")
    trainer = Trainer(settings, TrainEngine(settings))
    try:
        await trainer.start(nc)
        js = nc.jetstream()
        events = await nc.subscribe(S.metrics("eval"))
        await trainer.feeder.feed_once()
        [task] = await take_prompts(js, S.prompts_train, S.rollout_consumer, 1)
        await publish_group(js, RUN, task.prompt_id, make_group(tiny_model, task.data["answer"]))
        assert await trainer.step() is not None and trainer.version == 1

        evals = await take_prompts(js, S.prompts_eval, "eval-test", 5)
        ids = [f"eval1-{i}.{trainer.feeder.nonce}" for i in range(3)]
        assert sorted(t.prompt_id for t in evals) == ids
        assert all(t.is_eval for t in evals)
        await js.publish(S.trajectories_eval, b"not arrow", headers={"Jetrl-Prompt-Id": "eval9-0"}, stream=TRAJECTORIES_STREAM)
        await _answer(js, tiny_model, ids[0], [1.0, 1.0, 0.0, 0.5])
        await _answer(js, tiny_model, ids[1], [1.0, 0.0, 0.0, 0.0])
        await _answer(js, tiny_model, ids[1], [1.0, 1.0, 1.0, 1.0])  # a redelivered episode: not counted twice
        await _reject(js, ids[2])

        event = decode(MetricsEvent, (await events.next_msg(timeout=10)).data)
        assert (event.service, event.step) == ("eval", 1)
        v = event.values
        assert v["eval_groups"] == 2 and v["eval_rejected"] == 1 and v["eval_complete"] == 1
        assert v["eval_reward_mean"] == pytest.approx(3.5 / 8) and v["eval_accuracy"] == pytest.approx(3 / 8)
        assert v["eval_malformed_messages"] == 1  # the garbage was counted and skipped
        assert trainer.feeder.evals is not None and not trainer.feeder.evals.rounds
    finally:
        await trainer.close()
        await nc.close()


@pytest.mark.timeout(180)
async def test_an_eval_round_issued_again_after_a_resume_is_answered(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    """Resumed from a checkpoint before step 1, the trainer issues step 1's eval round again within
    JetStream's de-duplication window: its answers must not be dropped as repeats of the first round's."""
    settings = TrainerSettings(
        run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), batch_groups=1,
        checkpoint_every=0, weights={"transport": "none"}, fetch_timeout_s=0.2, resume="auto",
        feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 10)), "max_in_flight": 1,
                "eval_dataset_path": str(write_dataset(tmp_path / "e.jsonl", 5)), "eval_every": 1, "eval_size": 2,
                "eval_timeout_s": 20},
    )
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    events = await nc.subscribe(S.metrics("eval"))
    try:
        for incarnation in range(2):
            trainer = Trainer(settings, TrainEngine(settings))
            try:
                await trainer.start(nc)
                assert trainer.version == 0 and trainer.resumed == bool(incarnation)
                if not incarnation:
                    await trainer.checkpoint()  # version 0: the second incarnation trains step 1 again
                    await trainer.feeder.feed_once()
                    [task] = await take_prompts(js, S.prompts_train, S.rollout_consumer, 1)
                    await publish_group(js, RUN, task.prompt_id, make_group(tiny_model, task.data["answer"]))
                assert await trainer.step() is not None and trainer.version == 1
                evals = await take_prompts(js, S.prompts_eval, "eval-test", 5)
                assert len(evals) == 2
                for t in evals:  # answered as a worker does: Nats-Msg-Id derived from the prompt id
                    await _answer(js, tiny_model, t.prompt_id, [1.0, 0.0])
                event = decode(MetricsEvent, (await events.next_msg(timeout=15)).data)
                assert event.step == 1 and event.values["eval_complete"] == 1 and event.values["eval_groups"] == 2
            finally:
                await trainer.close()
    finally:
        await nc.close()


@pytest.mark.timeout(120)
async def test_eval_at_start_issues_the_baseline_round_before_the_first_step(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    """`feeder.eval_at_start`: the eval set goes out when a fresh trainer starts, as round 0 (the pass
    rate a run's later rounds are read against); nothing is trained for it."""
    run = "ev0"
    s0 = Subjects(run)
    settings = TrainerSettings(
        run=run, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), batch_groups=1,
        checkpoint_every=0, weights={"transport": "none"}, fetch_timeout_s=0.2,
        feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 10)), "max_in_flight": 1,
                "eval_dataset_path": str(write_dataset(tmp_path / "e.jsonl", 5)), "eval_every": 10, "eval_size": 2,
                "eval_at_start": True},
    )
    nc = await connect(nats_url, "test")
    trainer = Trainer(settings, TrainEngine(settings))
    try:
        events = await nc.subscribe(s0.metrics("eval"))
        await trainer.start(nc)
        js = nc.jetstream()
        evals = await take_prompts(js, s0.prompts_eval, "eval-start", 5)
        assert sorted(t.prompt_id for t in evals) == [f"eval0-{i}.{trainer.feeder.nonce}" for i in range(2)]
        assert trainer.version == 0
        for t, rewards in zip(evals, ([1.0, 0.0], [0.0, 0.0]), strict=True):
            tensors = make_group(tiny_model, "123", group_size=2)
            tensors["rewards"] = np.array(rewards, dtype=np.float32)
            body, meta = encode_group_with_meta(tensors, run=run, prompt_id=t.prompt_id, worker="test", is_eval=True)
            await js.publish(s0.trajectories_eval, body, headers=trajectory_headers(meta), stream=TRAJECTORIES_STREAM)
        event = decode(MetricsEvent, (await events.next_msg(timeout=10)).data)
        assert event.step == 0 and event.values["eval_complete"] == 1
        assert event.values["eval_accuracy"] == pytest.approx(1 / 4)
    finally:
        await trainer.close()
        await nc.close()


@pytest.mark.timeout(60)
async def test_an_unfinished_eval_round_is_reported_at_its_timeout(nats_url: str, tiny_model: Path) -> None:
    nc = await connect(nats_url, "test")
    rounds = EvalRounds(nc, RUN, timeout_s=0.3)
    try:
        js = nc.jetstream()
        await declare_streams(js)
        events = await nc.subscribe(S.metrics("eval"))
        await rounds.start()
        rounds.expect(4, ["eval4-0", "eval4-1", "eval4-2"])
        await js.publish(S.trajectories_eval, b"\x00garbage", headers={"Jetrl-Prompt-Id": "eval4-1"}, stream=TRAJECTORIES_STREAM)
        await _answer(js, tiny_model, "eval4-0", [1.0, 0.0])
        # eval4-2 never comes back

        event = decode(MetricsEvent, (await events.next_msg(timeout=10)).data)
        assert (event.service, event.step) == ("eval", 4)
        v = event.values
        assert v["eval_complete"] == 0 and v["eval_expected"] == 3
        assert v["eval_groups"] == 1 and v["eval_rejected"] == 0 and v["eval_malformed"] == 1
        assert v["eval_reward_mean"] == pytest.approx(0.5) and v["eval_accuracy"] == pytest.approx(0.5)
        assert not rounds.rounds
    finally:
        await rounds.close()
        await nc.close()


@pytest.mark.timeout(120)
async def test_a_run_that_ends_at_an_eval_step_reports_that_round_before_it_finishes(nats_url: str, tiny_model: Path,
                                                                                      tmp_path: Path) -> None:
    """total_steps a multiple of eval_every: the round issued after the last step is waited for and
    reported (a user's last eval point), not dropped as the trainer exits; a stop ends the wait."""
    import asyncio

    settings = TrainerSettings(
        run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), batch_groups=1,
        total_steps=1, checkpoint_every=0, weights={"transport": "none"}, fetch_timeout_s=0.2,
        feeder={"dataset_path": str(write_dataset(tmp_path / "d.jsonl", 10)), "max_in_flight": 1,
                "eval_dataset_path": str(write_dataset(tmp_path / "e.jsonl", 5)), "eval_every": 1, "eval_size": 2},
    )
    nc = await connect(nats_url, "test")
    trainer = Trainer(settings, TrainEngine(settings))
    stopping = asyncio.Event()
    try:
        await trainer.start(nc)
        js = nc.jetstream()
        events = await nc.subscribe(S.metrics("eval"))
        await trainer.feeder.feed_once()
        [task] = await take_prompts(js, S.prompts_train, S.rollout_consumer, 1)
        await publish_group(js, RUN, task.prompt_id, make_group(tiny_model, task.data["answer"]))
        rounds = trainer.feeder.evals
        assert rounds is not None
        run = asyncio.create_task(trainer.run(stopping))
        open_at_end: list[list[int]] = []
        run.add_done_callback(lambda _: open_at_end.append(sorted(rounds.rounds)))
        evals = await take_prompts(js, S.prompts_eval, "eval-test", 2)  # issued after the last step
        for _ in range(600):  # until the trainer's last step is done (under load that takes longer than any fixed sleep)
            if trainer.done or run.done():
                break
            await asyncio.sleep(0.05)
        assert trainer.done and not run.done()  # done training, still waiting for the round's answers
        for t in evals:
            await _answer(js, tiny_model, t.prompt_id, [1.0, 0.0])
        await asyncio.wait_for(run, 30)
        assert open_at_end == [[]]  # the run ended once the round was reported, not with it open
        event = decode(MetricsEvent, (await events.next_msg(timeout=10)).data)
        assert (event.service, event.step) == ("eval", 1) and event.values["eval_complete"] == 1
        assert event.values["eval_accuracy"] == pytest.approx(0.5)

        # the same wait ends with a stop (Ctrl-C while the last round is out)
        rounds.expect(2, ["eval2-0"])
        waiting = asyncio.create_task(trainer.feeder.evals_reported(stopping))
        await asyncio.sleep(0)
        assert not waiting.done()
        stopping.set()
        await asyncio.wait_for(waiting, 5)
    finally:
        await trainer.close()
        await nc.close()
