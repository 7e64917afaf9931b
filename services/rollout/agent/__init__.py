"""Agent workflows (issue #11): an OpenAI/Anthropic-compatible proxy that records the exact tokens of
every completion an agent asks for, so agents written with any framework train without changes.

- `proxy.AgentProxy` / `server.ProxyServer`: sessions, completions through `InferenceEngine.agenerate`,
  rewards, export (docs/agent.md lists the endpoints);
- `cache.InteractionCache`: parent resolution and discounted returns;
- `export.export_session`: `individual` / `concat` samples; `export.interactions_to_tensors`;
- `workflow.AgentWorkflow`: any object with `async def run(data, **extra_kwargs)` as a rollout workflow.
"""

from __future__ import annotations

from services.rollout.agent.workflow import AgentWorkflow

__all__ = ["AgentWorkflow"]
