"""The workflow API (AReaL-lite's, on our bus): what one episode of a prompt produces.

`RolloutWorkflow.arun_episode(engine, data)` returns
- a padded tensor dict (`input_ids`, `attention_mask`, `loss_mask`, `logprobs`, `rewards`, `versions`;
  batch-first, one row per sample), which becomes one trajectory message,
- `None`: the prompt is rejected (a rejection marker is published, so the feeder's count closes),
- a dict of interactions (agent workflows through the proxy, the direct client, or any objects with
  AReaL's `to_tensor_dict()`): turned into a tensor dict by `interactions_to_tensors`.

`workflow_context` tells a running episode whether it is an evaluation and which task it serves, as a
context variable, so it follows the episode's task and every task it starts.
"""

from __future__ import annotations

import asyncio
import contextvars
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from services.common.refs import RefError, resolve_ref
from services.rollout.failures import note_shrunk
from services.rollout.tensors import TensorDict, concat_padded


class WorkflowError(TypeError):
    """A workflow that cannot be resolved or returned something outside the contract. Retrying the
    episode cannot help, so the worker rejects the prompt at once."""


# ----------------------------------------------------------------------------------------- context


@dataclass(frozen=True)
class WorkflowContext:
    is_eval: bool = False
    task_id: int | None = None
    """AReaL's: an integer per episode task (the worker counts its prompts' episodes)."""
    prompt_id: str | None = None
    """jetrl's: the prompt's id on the bus (`<epoch>-<row>[-r<n>]`), the same on every retry."""

    def stat_scope(self) -> str:
        """Where an episode's statistics go: evaluation figures never mix with training ones."""
        return "eval-rollout" if self.is_eval else "rollout"


_CURRENT: contextvars.ContextVar[WorkflowContext] = contextvars.ContextVar(
    "jetrl_workflow_context", default=WorkflowContext()
)


class _ContextSet:
    """What `workflow_context.set(...)` returns: the context is set at once (AReaL's `set(ctx)`), and
    as a `with` block it is put back when the block ends (jetrl's worker uses it so)."""

    def __init__(self, ctx: WorkflowContext) -> None:
        self.ctx = ctx
        self._token = _CURRENT.set(ctx)

    def __enter__(self) -> WorkflowContext:
        return self.ctx

    def __exit__(self, *exc: Any) -> None:
        _CURRENT.reset(self._token)


class _WorkflowContextAccess:
    """`workflow_context.is_eval`, `.task_id` (an int, as AReaL's), `.prompt_id`, `.stat_scope()`,
    `.get()` read the running episode's context; `workflow_context.set(ctx)` or
    `with workflow_context.set(is_eval=..., task_id=..., prompt_id=...)` sets
    it (the worker does this); `await workflow_context.get_httpx_client()` /
    `get_aiohttp_session()` give the shared HTTP client of the running event loop, as AReaL's do."""

    def get(self) -> WorkflowContext:
        return _CURRENT.get()

    def set(self, ctx: WorkflowContext | None = None, *, is_eval: bool = False, task_id: int | None = None,
            prompt_id: str | None = None) -> _ContextSet:
        return _ContextSet(ctx if ctx is not None else WorkflowContext(is_eval=is_eval, task_id=task_id, prompt_id=prompt_id))

    @property
    def is_eval(self) -> bool:
        return _CURRENT.get().is_eval

    @property
    def task_id(self) -> int | None:
        return _CURRENT.get().task_id

    @property
    def prompt_id(self) -> str | None:
        return _CURRENT.get().prompt_id

    def stat_scope(self) -> str:
        return _CURRENT.get().stat_scope()

    async def get_httpx_client(self) -> Any:
        """One `httpx.AsyncClient` per event loop, shared by the episodes it runs."""
        return _shared("httpx", lambda: __import__("httpx").AsyncClient(timeout=3600.0))

    async def get_aiohttp_session(self) -> Any:
        """One `aiohttp.ClientSession` per event loop, shared by the episodes it runs."""
        import aiohttp

        return _shared("aiohttp", lambda: aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600.0)))


_CLIENTS: dict[tuple[int, str], Any] = {}


def _shared(kind: str, make: Any) -> Any:
    loop = asyncio.get_running_loop()
    key = (id(loop), kind)
    client = _CLIENTS.get(key)
    if client is None or getattr(client, "is_closed", False) or getattr(client, "closed", False):
        client = _CLIENTS[key] = make()
    return client


workflow_context = _WorkflowContextAccess()


# ---------------------------------------------------------------------------------------- workflows


class RolloutWorkflow(ABC):
    """One episode of one prompt. Subclass it and implement `arun_episode`."""

    needs_grammar: ClassVar[bool] = False
    """True for a workflow whose requests carry `json_schema` / `regex` / `ebnf`: `jetrl up` then starts
    the inference servers with their tokenizer (SGLang's grammar backend needs it; docs/inference.md)."""

    @abstractmethod
    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> TensorDict | dict[str, Any] | None:
        """Run the episode for the dataset row `data` with the inference `engine`
        (`services.rollout.engine.InferenceEngine`)."""


def is_interactions(result: Mapping[str, Any]) -> bool:
    """A dict of interactions maps ids to interaction objects; a tensor dict maps names to arrays."""
    return bool(result) and not any(hasattr(v, "shape") for v in result.values())


def interactions_to_tensors(interactions: Mapping[str, Any]) -> TensorDict:
    """A dict of interactions as one padded tensor dict, one row each: the proxy's exported samples
    (`to_tensors()`), or any object with AReaL's `to_tensor_dict()` (a batch-1 tensor dict, such as
    AReaL's `InteractionWithTokenLogpReward`)."""
    rows = []
    for key, item in interactions.items():
        to_tensors = getattr(item, "to_tensors", None) or getattr(item, "to_tensor_dict", None)
        if to_tensors is None:
            raise WorkflowError(
                f"interaction {key!r} is a {type(item).__name__}; a dict of interactions must hold exported samples "
                "(services.rollout.agent.export.AgentSample) or objects with to_tensor_dict()"
            )
        row = to_tensors()
        if not isinstance(row, Mapping) and not hasattr(row, "items"):
            raise WorkflowError(f"interaction {key!r}: to_tensor_dict() returned {type(row).__name__}, not a tensor dict")
        check_tensor_dict(dict(row.items()), f"interaction {key!r}: to_tensor_dict()")
        rows.append(dict(row.items()))
    if not rows:
        raise WorkflowError("the workflow returned an empty dict of interactions")
    return concat_padded(rows)


TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")
"""Per-token tensors of the contract: `[batch, seq]`, all of one shape."""


def _shape(key: str, value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", None)
    if shape is None:
        try:
            shape = np.shape(value)
        except ValueError as exc:  # ragged nested lists
            raise WorkflowError(f"returned tensor dict: {key} is not an array ({type(value).__name__}): {exc}") from exc
    return tuple(int(n) for n in shape)


def check_tensor_dict(result: Mapping[str, Any], where: str = "returned tensor dict") -> None:
    """The shapes of one returned tensor dict, before anything indexes into them: per-token keys
    `[batch, seq]` (a `[seq]` tensor where `[1, seq]` is meant is the usual slip), `rewards` `[batch]`,
    any other key `[batch]` or `[batch, seq]`. A mistake is a WorkflowError naming the key, its shape
    and the shape expected: the workflow's bug, which no retry fixes."""
    shapes = {key: _shape(key, value) for key, value in result.items()}
    anchor = "attention_mask" if "attention_mask" in shapes else "input_ids" if "input_ids" in shapes else None
    if anchor is None:
        raise WorkflowError(f"{where}: no input_ids or attention_mask (keys: {sorted(result)})")
    ref = shapes[anchor]
    if len(ref) != 2:
        hint = f" (e.g. [1, {ref[0]}]: add the batch dimension, `t.unsqueeze(0)`)" if len(ref) == 1 else ""
        raise WorkflowError(f"{where}: {anchor} has shape {list(ref)}, expected [batch, seq]{hint}")
    batch, seq = ref
    for key, shape in shapes.items():
        if key in TOKEN_KEYS:
            if shape != ref:
                raise WorkflowError(f"{where}: {key} has shape {list(shape)}, expected [batch, seq] = {[batch, seq]} like {anchor}")
        elif key == "rewards":
            if shape != (batch,):
                raise WorkflowError(f"{where}: rewards has shape {list(shape)}, expected [batch] = [{batch}] (one reward per sample)")
        elif shape not in ((batch,), (batch, seq)):
            raise WorkflowError(f"{where}: {key} has shape {list(shape)}, expected [{batch}] (per sample) or {[batch, seq]} (per token)")


def as_tensor_dict(result: TensorDict | dict[str, Any] | None) -> TensorDict | None:
    """Normalise what `arun_episode` returned: a tensor dict (shapes checked) or None; anything else is
    a WorkflowError."""
    if result is None:
        return None
    if not isinstance(result, Mapping):
        raise WorkflowError(
            f"arun_episode returned {type(result).__name__}; expected a tensor dict, None or a dict of interactions"
        )
    if is_interactions(result):
        return interactions_to_tensors(result)
    check_tensor_dict(result)
    return dict(result)


class GroupedRolloutWorkflow(RolloutWorkflow):
    """Runs `group_size` episodes of the wrapped workflow concurrently and concatenates the accepted
    ones (padded to the longest); None when every episode was rejected. If one episode raises, the
    others are cancelled and the error propagates (the worker retries the whole prompt)."""

    def __init__(self, workflow: RolloutWorkflow, group_size: int) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.workflow = workflow
        self.group_size = group_size

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> TensorDict | None:
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.workflow.arun_episode(engine, data)) for _ in range(self.group_size)]
        except ExceptionGroup as group:
            # the first episode's own error, so the worker sees (and classifies) what went wrong
            first: BaseException = group
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from group
        results = [as_tensor_dict(t.result()) for t in tasks]
        kept = [r for r in results if r is not None]
        if kept and len(kept) < self.group_size:
            note_shrunk(len(kept), self.group_size)
        return concat_padded(kept) if kept else None


# --------------------------------------------------------------------------------------- resolution


def import_ref(ref: str) -> Any:
    """The object a workflow reference names ("package.module:Name", AReaL's "package.module.Name", or
    "path/file.py:Name"; `services.common.refs`); a reference that does not resolve is a WorkflowError."""
    try:
        return resolve_ref(ref)
    except RefError as exc:
        raise WorkflowError(f"workflow {exc}") from exc

