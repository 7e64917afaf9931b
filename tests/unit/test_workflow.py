"""The workflow API: resolution from instance / class / string, the episode context, grouping."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from services.rollout.resolve import resolve_workflow
from services.rollout.tensors import sample_tensors
from services.rollout.workflow import (
    GroupedRolloutWorkflow,
    RolloutWorkflow,
    WorkflowError,
    as_tensor_dict,
    workflow_context,
)
from services.rollout.workflows.synthetic import SyntheticWorkflow


class LengthWorkflow(RolloutWorkflow):
    """Sample i of a group has i+1 completion tokens; `reject` decides per call whether it is kept."""

    def __init__(self, reject: set[int] | None = None, raise_on: int | None = None) -> None:
        self.calls = 0
        self.reject = reject or set()
        self.raise_on = raise_on

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        i = self.calls
        self.calls += 1
        await asyncio.sleep(0)
        if i == self.raise_on:
            raise RuntimeError("episode broke")
        if i in self.reject:
            return None
        return sample_tensors([5, 6], [7] * (i + 1), [-0.1] * (i + 1), [3] * (i + 1), reward=float(i))


class Agent:
    async def run(self, data: dict[str, Any]) -> float:
        return 0.0


def test_resolve_from_instance_class_and_string() -> None:
    inst = SyntheticWorkflow(group_size=2)
    assert resolve_workflow(inst) is inst
    made = resolve_workflow(SyntheticWorkflow, {"group_size": 3, "delay_s": 0.5})
    assert isinstance(made, SyntheticWorkflow) and made.group_size == 3 and made.delay_s == 0.5
    from_str = resolve_workflow("services.rollout.workflows.synthetic:SyntheticWorkflow", {"completion_len": 2})
    assert isinstance(from_str, SyntheticWorkflow) and from_str.completion_len == 2


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("no_colon_here", {}, "expected 'package.module:Name'"),
        ("services.rollout.nope:X", {}, "cannot import module 'services.rollout.nope'"),
        ("services.rollout.workflows.synthetic:Missing", {}, "has no attribute 'Missing'"),
        ("services.rollout.workflow:WorkflowContext", {}, "is not a RolloutWorkflow"),
        ("services.rollout.workflow:RolloutWorkflow", {}, "abstract"),
        (SyntheticWorkflow, {"bogus": 1}, "bad workflow_kwargs ['bogus']"),
        (SyntheticWorkflow(), {"group_size": 1}, "already an instance"),
    ],
)
def test_resolve_errors_name_the_problem(spec: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(WorkflowError) as err:
        resolve_workflow(spec, kwargs)
    assert message in str(err.value)


def test_agents_and_interactions_go_through_the_agent_extension() -> None:
    from services.rollout.agent.workflow import AgentWorkflow

    wrapped = resolve_workflow(Agent(), {"tokenizer": object()})
    assert isinstance(wrapped, AgentWorkflow) and isinstance(wrapped.agent, Agent)
    with pytest.raises(WorkflowError, match="exported samples"):
        as_tensor_dict({"call-1": object()})
    with pytest.raises(WorkflowError, match="returned list"):
        as_tensor_dict([1, 2])  # type: ignore[arg-type]


async def test_workflow_context_follows_the_episode_and_its_tasks() -> None:
    assert workflow_context.stat_scope() == "rollout" and workflow_context.task_id is None

    async def inner() -> tuple[bool, int | None, str | None, str]:
        await asyncio.sleep(0)
        return workflow_context.is_eval, workflow_context.task_id, workflow_context.prompt_id, workflow_context.stat_scope()

    with workflow_context.set(is_eval=True, task_id=1, prompt_id="t1"):
        with_eval = await asyncio.gather(inner(), inner())
    with workflow_context.set(task_id=2, prompt_id="t2"):
        train = await inner()
    assert with_eval == [(True, 1, "t1", "eval-rollout")] * 2
    assert train == (False, 2, "t2", "rollout")
    assert workflow_context.get().task_id is None  # reset after the block
    # AReaL's spelling: set(ctx) sets at once
    from services.rollout.workflow import WorkflowContext

    async def areal_style() -> int | None:
        workflow_context.set(WorkflowContext(is_eval=False, task_id=7))
        return workflow_context.task_id

    assert await asyncio.create_task(areal_style()) == 7 and workflow_context.task_id is None


async def test_grouped_concatenates_kept_samples_padded_to_the_longest() -> None:
    inner = LengthWorkflow(reject={1})
    group = await GroupedRolloutWorkflow(inner, 4).arun_episode(None, {})
    assert group is not None and inner.calls == 4
    assert group["input_ids"].shape == (3, 6)  # samples 0, 2, 3 kept; longest is 2 + 4 tokens
    assert group["attention_mask"].sum(dim=1).tolist() == [3, 5, 6]
    assert group["rewards"].tolist() == [0.0, 2.0, 3.0]
    assert group["versions"][0].tolist() == [-1, -1, 3, 0, 0, 0]  # prompt -1, padding 0
    assert group["loss_mask"][1].tolist() == [0, 0, 1, 1, 1, 0]
    assert group["logprobs"].dtype == torch.float32 and group["input_ids"].dtype == torch.int64


async def test_grouped_all_rejected_is_none_and_an_error_propagates() -> None:
    assert await GroupedRolloutWorkflow(LengthWorkflow(reject={0, 1, 2}), 3).arun_episode(None, {}) is None
    with pytest.raises(RuntimeError, match="episode broke"):
        await GroupedRolloutWorkflow(LengthWorkflow(raise_on=1), 3).arun_episode(None, {})
    with pytest.raises(ValueError, match="group_size"):
        GroupedRolloutWorkflow(LengthWorkflow(), 0)


async def test_workflow_context_shares_one_http_client_per_event_loop_as_areals_does() -> None:
    import aiohttp
    import httpx

    async def clients() -> tuple[Any, Any]:
        return await workflow_context.get_httpx_client(), await workflow_context.get_aiohttp_session()

    first, second = await asyncio.gather(clients(), asyncio.create_task(clients()))
    try:
        assert isinstance(first[0], httpx.AsyncClient) and isinstance(first[1], aiohttp.ClientSession)
        assert first[0] is second[0] and first[1] is second[1]  # one per loop, shared by its episodes
        await first[0].aclose()
        assert (await workflow_context.get_httpx_client()) is not first[0]  # a closed one is replaced
    finally:
        await first[1].close()
        await (await workflow_context.get_httpx_client()).aclose()
