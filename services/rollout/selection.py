"""AReaL's two trainer-side choices about episodes, as rollout settings:

- `eval_workflow` / `eval_workflow_kwargs`: evaluation prompts run another workflow (`EvalOrTrain`
  picks by `workflow_context.is_eval`);
- `should_accept_fn`: a function of an episode's (or group's) tensor dict that says whether to keep
  it; a group it refuses is rejected like one the workflow returned None for, counted
  (`groups_not_accepted_total` on METRICS) and logged (`Accepting`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.rollout.engine_api import InferenceEngine
from services.rollout.failures import note_not_accepted
from services.rollout.tensors import TensorDict
from services.rollout.workflow import RolloutWorkflow, as_tensor_dict, workflow_context


class EvalOrTrain(RolloutWorkflow):
    """`eval_workflow` for evaluation prompts, `workflow` for the others."""

    def __init__(self, workflow: RolloutWorkflow, eval_workflow: RolloutWorkflow) -> None:
        self.workflow = workflow
        self.eval_workflow = eval_workflow

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict | dict[str, Any] | None:
        chosen = self.eval_workflow if workflow_context.is_eval else self.workflow
        return await chosen.arun_episode(engine, data)


class Accepting(RolloutWorkflow):
    """The wrapped workflow's result, or None where `should_accept_fn(result)` is false."""

    def __init__(self, workflow: RolloutWorkflow, should_accept_fn: Callable[[TensorDict], Any]) -> None:
        self.workflow = workflow
        self.should_accept_fn = should_accept_fn

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict | None:
        result = as_tensor_dict(await self.workflow.arun_episode(engine, data))
        if result is None or self.should_accept_fn(result):
            return result
        note_not_accepted()
        return None
