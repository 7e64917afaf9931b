"""Resolving the workflow a rollout worker runs: an instance, a class (+ kwargs), a reference string
(`"pkg.mod:Class"` or AReaL's `"pkg.mod.Class"`), or an agent (any object with `async def run()`),
which is wrapped to run against the OpenAI/Anthropic-compatible proxy. Kept apart from the workflow
API (`workflow.py`), which knows no implementation, as AReaL keeps its engine's resolver apart from
`areal/api/workflow_api.py`."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from services.rollout.kwargs import resolve_callable_kwargs
from services.rollout.workflow import RolloutWorkflow, WorkflowError, import_ref


def is_agent(obj: Any) -> bool:
    run = getattr(obj, "run", None)
    return run is not None and inspect.iscoroutinefunction(run)


def wrap_agent(agent: Any, kwargs: Mapping[str, Any]) -> RolloutWorkflow:
    """Extension point for agents (any object or class with `async def run()`): wrap it in
    a workflow that runs it against the OpenAI-compatible proxy and records its interactions.

    `kwargs` as AReaL passes `workflow_kwargs` to an agent: the agent workflow's own settings
    (`mode`, `discount`, `max_new_tokens`, ...: `AgentWorkflow`'s parameters) stay with it; every
    other key is the agent's constructor argument, as are those in jetrl's `agent_kwargs`."""
    from services.rollout.agent.workflow import AgentWorkflow

    own = set(inspect.signature(AgentWorkflow).parameters) - {"agent"}
    mine = {k: v for k, v in kwargs.items() if k in own}
    theirs = {k: v for k, v in kwargs.items() if k not in own}
    if theirs:
        given = mine.get("agent_kwargs") or {}
        if isinstance(given, str):
            import json

            given = json.loads(given)
        mine["agent_kwargs"] = {**theirs, **dict(given)}
        if isinstance(agent, type):
            agent_kwargs = resolve_callable_kwargs(agent, mine["agent_kwargs"], "workflow_kwargs")
            mine["agent_kwargs"] = agent_kwargs
    try:
        return AgentWorkflow(agent, **mine)
    except TypeError as exc:
        raise WorkflowError(f"agent {agent!r}: bad workflow_kwargs {sorted(kwargs)}: {exc}") from exc


def resolve_workflow(spec: Any, kwargs: Mapping[str, Any] | None = None) -> RolloutWorkflow:
    """A workflow from an instance, a class (+ `kwargs`), or a "module:Class" / "module.Class" string (+ `kwargs`)."""
    kwargs = dict(kwargs or {})
    if isinstance(spec, str):
        spec = import_ref(spec)
    if isinstance(spec, RolloutWorkflow):
        if kwargs:
            raise WorkflowError(
                f"workflow {type(spec).__name__} is already an instance; workflow_kwargs {sorted(kwargs)} cannot apply"
            )
        return spec
    if isinstance(spec, type) and issubclass(spec, RolloutWorkflow):
        if inspect.isabstract(spec):
            raise WorkflowError(f"workflow {spec.__name__} is abstract: implement arun_episode")
        try:
            inspect.signature(spec).bind(**kwargs)
        except TypeError as exc:
            raise WorkflowError(f"workflow {spec.__name__}: bad workflow_kwargs {sorted(kwargs)}: {exc}") from exc
        return spec(**kwargs)
    if is_agent(spec):
        return wrap_agent(spec, kwargs)
    raise WorkflowError(
        f"workflow {spec!r} is not a RolloutWorkflow instance or subclass, an agent with `async def run`, "
        "nor a 'module:Class' string naming one"
    )


def needs_grammar(spec: str) -> bool:
    """Whether the workflow `spec` names may send constrained requests (`json_schema` / `regex` /
    `ebnf`), so that its inference servers need a grammar backend (their tokenizer): an agent (the
    proxy turns `response_format` and `tool_choice` into grammars), or a workflow class or instance
    with `needs_grammar`. Imports the module; a reference that does not resolve raises WorkflowError."""
    obj = import_ref(spec)
    if isinstance(obj, RolloutWorkflow) or (isinstance(obj, type) and issubclass(obj, RolloutWorkflow)):
        return bool(obj.needs_grammar)
    return is_agent(obj)
