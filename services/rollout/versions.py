"""Weight versions a workflow returns, checked before its group leaves the worker.

Staleness is judged on the trained tokens (loss_mask != 0): each needs the version of the weights
that generated it. Two things cannot be true of a real group, and the trainer could only mistake
them for staleness (a group dropped and re-issued, over and over, with nobody told why):
- a trained token with no version (negative): the workflow lost `output_versions` somewhere;
- a trained token newer than any version the inference servers reported to this worker: the
  workflow made its versions up (a step counter, a constant) instead of copying the engine's.

`CheckedWorkflow` wraps the workflow the service runs: it hands the episode an engine that notes the
newest version in every `agenerate` reply, then checks the returned group. A failed check is a
`WorkflowError` naming the workflow: logged and counted here, and, as a permanent error, the prompt is
rejected at once with that text as the reason (never retried into the same error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common.logging import get_logger
from services.rollout.engine_api import InferenceEngine
from services.rollout.io_struct import ModelRequest, ModelResponse
from services.rollout.tensors import TensorDict
from services.rollout.workflow import GroupedRolloutWorkflow, RolloutWorkflow, WorkflowError, as_tensor_dict

log = get_logger("rollout.workflow")


def workflow_name(workflow: Any) -> str:
    """"module.Class" of what the user wrote: through the wrappers (`GroupedRolloutWorkflow`,
    `CheckedWorkflow`) to their workflow, and to the agent of an agent workflow."""
    from services.rollout.selection import Accepting, EvalOrTrain

    while isinstance(workflow, (GroupedRolloutWorkflow, CheckedWorkflow, Accepting, EvalOrTrain)):
        workflow = workflow.workflow
    target = getattr(workflow, "agent_spec", None) or workflow
    if isinstance(target, str):
        return target
    cls = target if isinstance(target, type) else type(target)
    return f"{cls.__module__}.{cls.__qualname__}"


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def check_versions(tensors: TensorDict, workflow: str, newest_seen: int) -> None:
    """Raise WorkflowError if a trained token has no version, or one newer than `newest_seen` (the
    newest version the inference servers reported; -1: none reported, nothing to compare with)."""
    if "versions" not in tensors or "loss_mask" not in tensors:
        return  # the encoder names the missing key
    versions, loss = _numpy(tensors["versions"]), _numpy(tensors["loss_mask"])
    if versions.shape != loss.shape:
        return  # the encoder names the shape mismatch
    trained = versions[loss != 0]
    if not trained.size:
        return
    missing = int((trained < 0).sum())
    if missing:
        raise WorkflowError(
            f"workflow {workflow}: {missing} trained tokens (loss_mask != 0) have no weight version; copy the "
            "engine's ModelResponse.output_versions onto the generated tokens"
        )
    newest = int(trained.max())
    if newest_seen >= 0 and newest > newest_seen:
        raise WorkflowError(
            f"workflow {workflow}: trained tokens carry weight version {newest}, newer than any version the inference "
            f"servers reported ({newest_seen}); copy the engine's ModelResponse.output_versions instead of making versions up"
        )


@dataclass
class _Newest:
    version: int = -1


class VersionWatch:
    """The inference engine as an episode sees it: every attribute is the engine's, and
    `agenerate` also notes the newest version its replies carried."""

    def __init__(self, engine: Any, newest: _Newest) -> None:
        self._engine = engine
        self._newest = newest

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def agenerate(self, req: ModelRequest, *, episode: str | None = None) -> ModelResponse:
        resp: ModelResponse = await self._engine.agenerate(req, episode=episode)
        versions = getattr(resp, "output_versions", None)
        if versions:
            self._newest.version = max(self._newest.version, max(versions))
        return resp

    def release_episode(self, episode: str) -> None:
        self._engine.release_episode(episode)


class CheckedWorkflow(RolloutWorkflow):
    """`workflow`, with the versions of every group it returns checked (see the module doc)."""

    def __init__(self, workflow: RolloutWorkflow) -> None:
        self.workflow = workflow
        self.name = workflow_name(workflow)
        # across episodes: a reply seen by one episode makes its versions possible for all
        self._newest = _Newest()
        self.impossible = 0
        """Groups refused for impossible versions (also in the log, and as rejected prompts)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.workflow, name)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict | None:
        result = as_tensor_dict(await self.workflow.arun_episode(VersionWatch(engine, self._newest), data))
        if result is not None:
            try:
                check_versions(result, self.name, self._newest.version)
            except WorkflowError as exc:
                self.impossible += 1
                log.error("impossible weight versions; group refused", workflow=self.name, count=self.impossible, error=str(exc))
                raise
        return result
