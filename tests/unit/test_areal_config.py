"""Configuration as AReaL writes it: jetrl adds no default of its own to a user's workflow kwargs,
callables may be reference strings, `workflow_kwargs` reach an agent's constructor, generation
settings reach an agent named directly as the workflow, and `jetrl up` passes configured
environment variables through."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from services.rollout.service import build_workflow, standard_kwargs
from services.rollout.settings import RolloutSettings
from services.rollout.versions import CheckedWorkflow
from services.rollout.workflow import GroupedRolloutWorkflow, RolloutWorkflow, WorkflowError
from services.up.launch import passed_env
from services.up.settings import UpSettings
from tests.reward_fns import length


class NeedsRewardFn(RolloutWorkflow):
    def __init__(self, reward_fn: Callable[..., Any], tokenizer: Any, group_size: int = 1) -> None:
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        return None


class TakesAStringOrCallable(NeedsRewardFn):
    def __init__(self, reward_fn: Callable[..., Any] | str, tokenizer: Any, group_size: int = 1) -> None:
        super().__init__(reward_fn, tokenizer)


class Unannotated(RolloutWorkflow):
    """As AReaL's direct-client `multi_turn_v2.MultiTurnWorkflow` writes its constructor: no annotations."""

    def __init__(self, reward_fn, tokenizer, name="x") -> None:  # type: ignore[no-untyped-def]
        self.reward_fn, self.tokenizer, self.name = reward_fn, tokenizer, name

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        return None


class EchoAgent:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        return 1.0


def build(**settings: Any) -> Any:
    s = RolloutSettings(**settings)
    workflow = build_workflow(s, standard_kwargs(s, lambda: "TOKENIZER", None))
    while isinstance(workflow, (GroupedRolloutWorkflow, CheckedWorkflow)):
        workflow = workflow.workflow
    return workflow


def test_a_reward_fn_left_out_is_the_constructors_error_not_the_demos_copy3() -> None:
    with pytest.raises(WorkflowError, match="missing a required argument: 'reward_fn'"):
        build(workflow=f"{__name__}:NeedsRewardFn")
    # set in the rollout settings, it is offered (resolved: the parameter wants a callable)
    assert build(workflow=f"{__name__}:NeedsRewardFn", reward_fn="tests.reward_fns:length").reward_fn is length


@pytest.mark.parametrize("ref", ["tests.reward_fns:length", "tests.reward_fns.length"])
def test_callables_in_workflow_kwargs_may_be_reference_strings(ref: str) -> None:
    wf = build(workflow=f"{__name__}.NeedsRewardFn", workflow_kwargs={"reward_fn": ref})
    assert wf.reward_fn is length and wf.tokenizer == "TOKENIZER"
    # a parameter that takes a string too is left for the workflow to resolve, as AReaL's RLVRWorkflow does
    assert build(workflow=f"{__name__}:TakesAStringOrCallable", workflow_kwargs={"reward_fn": ref}).reward_fn == ref
    with pytest.raises(WorkflowError, match=r"workflow_kwargs\.reward_fn: .*no_such_fn"):
        build(workflow=f"{__name__}:NeedsRewardFn", workflow_kwargs={"reward_fn": "tests.reward_fns:no_such_fn"})
    # no annotation: a `*_fn` parameter's string is resolved (AReaL's name for functions); any other is left a string
    wf = build(workflow=f"{__name__}:Unannotated", workflow_kwargs={"reward_fn": ref, "name": "tests.reward_fns:length"})
    assert wf.reward_fn is length and wf.name == "tests.reward_fns:length"


def test_workflow_kwargs_reach_an_agent_as_areal_passes_them_and_generation_settings_apply() -> None:
    wf = build(workflow=f"{__name__}:EchoAgent", max_new_tokens=4, temperature=0.5,
               workflow_kwargs={"max_completion_tokens": 9, "mode": "inline", "agent_kwargs": {"extra": 1}})
    assert wf.agent.kwargs == {"max_completion_tokens": 9, "extra": 1}  # AReaL's keys and jetrl's agent_kwargs
    assert (wf.defaults.max_new_tokens, wf.defaults.temperature) == (4, 0.5)  # rollout settings, not 128 / 1.0
    assert wf.tokenizer == "TOKENIZER"


def test_up_passes_the_configured_environment_through_and_nothing_else() -> None:
    environ = {"PATH": "/bin", "OPENAI_API_KEY": "sk-1", "SECRET": "x"}
    assert passed_env(UpSettings(), environ) == {"PATH": "/bin"}
    assert passed_env(UpSettings(pass_env=["OPENAI_API_KEY", "UNSET"]), environ) == {"PATH": "/bin", "OPENAI_API_KEY": "sk-1"}


def keep_long(group: dict[str, Any]) -> bool:
    return int(group["attention_mask"].sum()) > 3


class Tagged(RolloutWorkflow):
    def __init__(self, tag: str, tokenizer: Any = None) -> None:
        self.tag = tag

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        from services.rollout.tensors import sample_tensors

        return sample_tensors([1], [2] * data["n"], [-0.1] * data["n"], [0] * data["n"], 1.0 if self.tag == "eval" else 0.0)


async def test_eval_workflow_runs_eval_prompts_and_should_accept_fn_filters_counted() -> None:
    from services.rollout.failures import EpisodeFailures, set_current
    from services.rollout.versions import workflow_name
    from services.rollout.workflow import workflow_context

    s = RolloutSettings(workflow=f"{__name__}:Tagged", workflow_kwargs={"tag": "train"}, group_size=1,
                        eval_workflow=f"{__name__}.Tagged", eval_workflow_kwargs={"tag": "eval"},
                        should_accept_fn=f"{__name__}:keep_long")
    workflow = build_workflow(s, standard_kwargs(s, lambda: "TOKENIZER", None))
    assert workflow_name(workflow) == f"{__name__}.Tagged"
    book = EpisodeFailures("w")
    set_current(book)
    with workflow_context.set(is_eval=True):
        assert float((await workflow.arun_episode(None, {"n": 3}))["rewards"][0]) == 1.0
    assert float((await workflow.arun_episode(None, {"n": 3}))["rewards"][0]) == 0.0
    assert await workflow.arun_episode(None, {"n": 1}) is None  # 2 tokens: not accepted
    assert book.counters()["groups_not_accepted_total"] == 1
