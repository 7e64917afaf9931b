"""The built-in workflows' published trajectories, in the real stack (CPU inference server, reward
service, NATS), are byte for byte the messages the public torch helpers give for the same replies:
the worker recording what the engine answered, the test rebuilding each group with `sample_tensors` /
`turn_tensors` + `concat_padded` and encoding it as the worker does."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from schemas.headers import is_rejection
from schemas.subjects import Subjects
from schemas.trajectory import decode_group, encode_group_with_meta
from services.reward.client import RewardClient
from services.reward.service import RewardService
from services.reward.settings import RewardSettings
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import SGLangClient
from services.rollout.tensors import concat_padded, sample_tensors, turn_tensors
from services.rollout.versions import workflow_name
from services.rollout.workflow import workflow_context
from services.rollout.workflows.common import encode_chat
from services.rollout.workflows.multi_turn import MultiTurnWorkflow
from services.rollout.workflows.rlvr import RLVRWorkflow
from tests.support.inference import spawn_server, wait_ready
from tests.support.reward import running_reward
from tests.support.rollout import RUN, collect, push_prompts, running_worker

S = Subjects(RUN)


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc = wait_ready(spawn_server(tiny_model, tmp_path_factory.mktemp("inf"), "weight_version='2'"))
    try:
        yield proc.url
    finally:
        proc.stop()


@pytest.fixture
async def reward(nc: NATS, nats_url: str) -> AsyncIterator[RewardService]:
    async with running_reward(RewardSettings(run=RUN, nats_url=nats_url, processes=1), nc) as svc:
        yield svc


class Recording:
    """The real engine; every reply kept per prompt, in the order the workflow asked."""

    def __init__(self, engine: SGLangClient) -> None:
        self.engine = engine
        self.calls: dict[str, list[list[Any]]] = defaultdict(list)
        """prompt id -> [episode, reply] per request, in the order the requests were made"""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def agenerate(self, req: Any, *, episode: str | None = None) -> Any:
        call: list[Any] = [episode, None]
        self.calls[workflow_context.prompt_id or ""].append(call)
        call[1] = await self.engine.agenerate(req, episode=episode)
        return call[1]


async def published(nc: NATS, server: str, workflow: Any, n: int) -> tuple[list[Any], Recording]:
    engine = Recording(SGLangClient(InferenceClientSettings(servers=[server])))
    try:
        async with running_worker(nc, RUN, workflow, engine, stop_timeout_s=15):
            await push_prompts(nc.jetstream(), n)
            msgs = await collect(nc.jetstream(), S.trajectories, n, timeout_s=60)
    finally:
        await engine.engine.aclose()
    assert len(msgs) == n and not any(is_rejection(m.headers) for m in msgs)
    return msgs, engine


def same_message(msg: Any, rebuilt: dict[str, Any], workflow: Any) -> None:
    meta = decode_group(msg.data).meta
    body, _ = encode_group_with_meta(rebuilt, run=RUN, prompt_id=meta.prompt_id, worker=meta.worker, is_eval=meta.is_eval,
                                     workflow=workflow_name(workflow))
    assert body == msg.data


async def test_rlvr_messages_are_the_torch_helpers_bytes(reward: RewardService, nc: NATS, server: str, tiny_model: Path) -> None:
    wf = RLVRWorkflow(str(tiny_model), RewardClient(nc), group_size=4, max_new_tokens=6)
    msgs, engine = await published(nc, server, wf, 3)
    for m in msgs:
        group = decode_group(m.data)
        prompt_id = group.meta.prompt_id
        prompt_ids = encode_chat(wf.tokenizer, f"{int(prompt_id[1:]):03d}=")
        replies = [reply for _, reply in engine.calls[prompt_id]]
        rewards = group.tensors["rewards"].tolist()
        samples = [sample_tensors(prompt_ids, r.output_ids, r.output_logprobs, r.output_versions, rw)
                   for r, rw in zip(replies, rewards, strict=True)]
        same_message(m, concat_padded(samples), wf)


async def test_multi_turn_messages_are_the_torch_helpers_bytes(reward: RewardService, nc: NATS, server: str, tiny_model: Path) -> None:
    wf = MultiTurnWorkflow(str(tiny_model), RewardClient(nc), group_size=2, max_turns=2, max_new_tokens=3)
    msgs, engine = await published(nc, server, wf, 2)
    for m in msgs:
        group = decode_group(m.data)
        prompt_id = group.meta.prompt_id
        prompt_ids = encode_chat(wf.tokenizer, f"{int(prompt_id[1:]):03d}=")
        turns: dict[str, list[Any]] = defaultdict(list)
        for episode, reply in engine.calls[prompt_id]:
            turns[str(episode)].append(reply)
        samples = []
        for i, episode in enumerate(sorted(turns)):
            segments: list[Any] = [(prompt_ids, False, None, None)]
            for k, resp in enumerate(turns[episode]):
                if k:
                    segments.append((wf.feedback_ids, False, None, None))
                segments.append((resp.output_ids, True, resp.output_logprobs, resp.output_versions))
            samples.append(turn_tensors(segments, float(group.tensors["rewards"][i]), len(prompt_ids)))
        same_message(m, concat_padded(samples), wf)
