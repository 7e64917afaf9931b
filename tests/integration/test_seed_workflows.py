"""Workflows written as the seed documents write them (tests/seed_workflows/, only the imports
changed) in the real stack: nats-server, the CPU inference server with the tiny model, the rollout
worker built as `jetrl rollout` builds it, and the trainer with its feeder. Their groups are
trained, not dropped as stale (the RolloutWorkflow example tags prompt tokens with version 0); the
direct client's interactions become trajectories; a workflow that invents versions newer than any
the servers reported is an error that names it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from schemas.headers import is_rejection
from schemas.messages import PromptTask, RejectionMarker, decode, encode
from schemas.subjects import Subjects
from schemas.trajectory import decode_group
from services.common.demo_task import make_copy3_rows
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import InferenceEngine, WeightUpdateMeta
from services.rollout.service import build_workflow, standard_kwargs
from services.rollout.settings import RolloutSettings
from services.rollout.versions import CheckedWorkflow
from services.rollout.worker import RolloutWorker
from services.rollout.workflow import GroupedRolloutWorkflow, RolloutWorkflow
from tests.integration.test_rollout_stack import inference
from tests.seed_workflows.rewards import copy3_reward_fn
from tests.support.rollout import collect, running_worker

RUN = "seeds"
S = Subjects(RUN)
GROUP = 3


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with inference(tiny_model, tmp_path_factory.mktemp("inf") / "server.log", "weight_version='0'") as url:
        yield url


def rows(n: int, *, chat: bool) -> list[dict[str, Any]]:
    """copy3 rows: `prompt` text for the RolloutWorkflow example, or chat `messages` (no `prompt`:
    AReaL's reward call passes `prompt=` and the row as `**data`, so a row must not have one)."""
    out = []
    for r in make_copy3_rows(n, seed=3):
        if chat:
            out.append({"id": r["id"], "answer": r["answer"], "messages": [{"role": "user", "content": r["prompt"]}]})
        else:
            out.append(r)
    return out


def seed_workflow(ref: str, tiny_model: Path, **workflow_kwargs: Any) -> RolloutWorkflow:
    """The workflow as `jetrl rollout workflow=<ref>` builds it (standard arguments, grouping, checks)."""
    from transformers import AutoTokenizer

    settings = RolloutSettings(run=RUN, workflow=ref, workflow_kwargs=workflow_kwargs, group_size=GROUP, max_new_tokens=4,
                               model_path=str(tiny_model))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    return build_workflow(settings, standard_kwargs(settings, lambda: tok, None))


def worker(nc: NATS, workflow: RolloutWorkflow, engine: InferenceEngine) -> contextlib.AbstractAsyncContextManager[RolloutWorker]:
    return running_worker(nc, RUN, workflow, engine, nak_delay_s=0.1)


async def push(nc: NATS, data: list[dict[str, Any]]) -> None:
    js = nc.jetstream()
    for row in data:
        pid = str(row["id"])
        task = encode(PromptTask(run=RUN, prompt_id=pid, data=row))
        await js.publish(S.prompts_train, task, headers={"Nats-Msg-Id": f"{RUN}/prompt/{pid}"})


# ------------------------------------------------------------------------------- with the trainer

SEEDS = {
    # the RolloutWorkflow reference's example: prompt tokens tagged version 0
    "example": ("tests.seed_workflows.rollout_workflow.MyWorkflow", {}, False),
    "rlvr": ("tests.seed_workflows.rlvr:RLVRWorkflow", {"reward_fn": copy3_reward_fn}, True),
    "multi_turn": ("tests.seed_workflows.multi_turn.MultiTurnWorkflow",
                   {"reward_fn": copy3_reward_fn, "max_turns": 2, "turn_discount": 0.5}, True),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", list(SEEDS))
async def test_seed_workflows_train_past_eta(
    seed: str, nc: NATS, nats_url: str, server: str, tiny_model: Path, tmp_path: Path
) -> None:
    """eta=1 and weights loaded into the server after every step: at version 2 a group whose oldest
    token (prompt included) is version 0 would be stale; judged on its trained tokens it is fresh."""
    from services.trainer.loop import Trainer
    from services.trainer.model.engine import TrainEngine
    from services.trainer.settings import TrainerSettings
    from services.weights.sender.sync import DiskWeights

    dataset = tmp_path / "d.jsonl"
    ref, kwargs, chat = SEEDS[seed]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows(40, chat=chat)))
    settings = TrainerSettings(
        run=RUN, nats_url=nats_url, model_path=str(tiny_model), output_dir=str(tmp_path / "out"), zero_stage=2,
        batch_groups=2, eta=1, checkpoint_every=0, fetch_timeout_s=0.2,
        feeder={"dataset_path": str(dataset), "max_in_flight": 4, "max_attempts": 1},
    )
    engine = InferenceEngine(InferenceClientSettings(servers=[server]))

    async def publish(version: int, step: int, hf_dir: Path) -> None:  # as the weights service would
        await engine.update_weights(WeightUpdateMeta(path=str(hf_dir), version=version))

    workflow = seed_workflow(ref, tiny_model, **kwargs)
    trainer = Trainer(settings, TrainEngine(settings), weights=DiskWeights(publish))
    await trainer.start(nc)
    stopping = asyncio.Event()
    feeding = asyncio.create_task(trainer.feeder.feed_forever(stopping))
    try:
        async with worker(nc, workflow, engine):
            for _ in range(3):
                values = await asyncio.wait_for(trainer.step(), 120)
                assert values is not None
    finally:
        stopping.set()
        await asyncio.wait_for(feeding, 10)
        await trainer.close()
        await engine.update_weights(WeightUpdateMeta(path=str(tiny_model), version=0))  # the next test starts at 0
        await engine.aclose()
    # Some groups may be stale for real (generated while the new weights were loading); with the old
    # rule every group from version 2 on was, and the third step never came.
    assert trainer.version == 3
    assert trainer.intake.counts["accepted"] == 6 and trainer.intake.counts["rejected"] == 0


# ------------------------------------------------------------------------------- rollout only


async def test_direct_client_interactions_become_trajectories(nc: NATS, server: str, tiny_model: Path) -> None:
    workflow = seed_workflow("tests.seed_workflows.direct_agent:MyWorkflow", tiny_model)
    engine = InferenceEngine(InferenceClientSettings(servers=[server]))
    try:
        async with worker(nc, workflow, engine):
            await push(nc, rows(2, chat=True))
            msgs = await collect(nc.jetstream(), S.trajectories, 2, timeout_s=90)
    finally:
        await engine.aclose()
    assert not any(is_rejection(m.headers) for m in msgs)
    for m in msgs:
        group = decode_group(m.data)
        t = group.tensors
        assert t["input_ids"].shape[0] == GROUP  # one completion per episode, the episode run GROUP times
        gen = t["loss_mask"] == 1
        assert gen.any(axis=1).all() and (t["versions"][gen] == 0).all() and (t["logprobs"][gen] < 0).all()
        assert (group.meta.head_version, group.meta.tail_version) == (0, 0)


async def test_invented_versions_are_an_error_naming_the_workflow(nc: NATS, server: str, tiny_model: Path) -> None:
    workflow = seed_workflow("tests.seed_workflows.rollout_workflow:FutureVersionsWorkflow", tiny_model)
    assert isinstance(workflow, GroupedRolloutWorkflow) and isinstance(workflow.workflow, CheckedWorkflow)
    engine = InferenceEngine(InferenceClientSettings(servers=[server]))
    try:
        async with worker(nc, workflow, engine):
            await push(nc, rows(2, chat=False))
            msgs = await collect(nc.jetstream(), S.trajectories, 2, timeout_s=90)
    finally:
        await engine.aclose()
    assert all(is_rejection(m.headers) for m in msgs)  # refused at once, not published as a group
    for m in msgs:
        reason = decode(RejectionMarker, m.data).reason
        assert "tests.seed_workflows.rollout_workflow.FutureVersionsWorkflow" in reason
        assert "version 99, newer than any version the inference servers reported (0)" in reason
        assert "attempt 1 of" in reason  # a permanent error: not retried into the same result
    assert workflow.workflow.impossible >= 2


async def test_direct_client_links_turns_and_discounts_rewards_back(server: str, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    from services.rollout.api import ArealOpenAI

    engine = InferenceEngine(InferenceClientSettings(servers=[server]))
    try:
        client = ArealOpenAI(engine=engine, tokenizer=AutoTokenizer.from_pretrained(tiny_model), max_new_tokens=3)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "123="}]
        first = await client.chat.completions.create(model="default", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "again"}]
        second = await client.chat.completions.create(model="default", messages=messages, temperature=0.5)
    finally:
        await engine.aclose()
    assert client.session.cache.get(second.id).parent is client.session.cache.get(first.id)  # one tree, as through the proxy
    client.set_last_reward(1.0)
    client.apply_reward_discount(turn_discount=0.5)
    samples = client.export_interactions(style="individual")
    assert {k: s.reward for k, s in samples.items()} == {first.id: 0.5, second.id: 1.0}
    for reply in (first, second):
        prompt_ids, generated = samples[reply.id].segments
        assert generated[1] and len(generated[0]) == reply.usage.completion_tokens and len(prompt_ids[0]) == reply.usage.prompt_tokens
        assert samples[reply.id].to_tensor_dict()["versions"][0, -1] == 0
