"""What runs in a subprocess-mode pool process: the agent, pointed at its session by environment
variables, so an agent written with the synchronous `openai.OpenAI()` (or `anthropic.Anthropic()`)
client needs no change at all.

The pool process is reused across episodes; the agent object is built once per process and the
environment is set per episode (one episode runs at a time in a process).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from typing import Any

from services.common.refs import resolve_ref

_AGENTS: dict[str, Any] = {}


def _agent(spec: Any, agent_kwargs: dict[str, Any]) -> Any:
    """The agent object: a "module:Name" reference is built once per process; a class is built per
    episode; an (unpickled) instance is used as is."""
    if not isinstance(spec, str):
        return spec(**agent_kwargs) if isinstance(spec, type) else spec
    key = spec + repr(sorted(agent_kwargs.items()))
    if key not in _AGENTS:
        obj = resolve_ref(spec)
        _AGENTS[key] = obj(**agent_kwargs) if isinstance(obj, type) else obj
    return _AGENTS[key]


def run_agent(spec: Any, agent_kwargs: dict[str, Any], data: dict[str, Any], base_url: str, session_url: str) -> Any:
    """Run one episode; returns what the agent's `run` returned (a float, a dict or None)."""
    os.environ["OPENAI_BASE_URL"] = base_url
    os.environ["OPENAI_API_KEY"] = os.environ.get("JETRL_AGENT_API_KEY", "jetrl")
    os.environ["ANTHROPIC_BASE_URL"] = session_url
    os.environ["ANTHROPIC_API_KEY"] = os.environ.get("JETRL_AGENT_API_KEY", "jetrl")
    agent = _agent(spec, agent_kwargs)
    # the session's root as `base_url`: it serves the OpenAI routes and Anthropic's /v1/messages alike
    extra = {"base_url": session_url, "api_key": os.environ["OPENAI_API_KEY"]}
    params = inspect.signature(agent.run).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        extra = {k: v for k, v in extra.items() if k in params}
    result = agent.run(data, **extra)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
