"""Agent workflows: an OpenAI/Anthropic-compatible proxy that records the exact tokens of
every completion an agent asks for, so agents written with any framework train without changes.

- `proxy.AgentProxy` / `server.ProxyServer`: sessions, completions through `InferenceEngine.agenerate`,
  rewards, export (docs/agent.md lists the endpoints);
- `cache.InteractionCache`: parent resolution and discounted returns;
- `export.export_session`: `individual` / `concat` samples; `export.interactions_to_tensors`;
- `workflow.AgentWorkflow`: any object with `async def run(data, **extra_kwargs)` as a rollout workflow.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AgentWorkflow"]


def __getattr__(name: str) -> Any:
    # lazy: a subprocess-mode pool process imports services.rollout.agent.child and must not pay for torch
    if name == "AgentWorkflow":
        from services.rollout.agent.workflow import AgentWorkflow

        return AgentWorkflow
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
