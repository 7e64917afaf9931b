"""A multi-turn agent with one tool, written with the official `openai` SDK and nothing from jetrl,
trained end to end by pointing its `base_url` at the rollout worker's proxy.

The task is the demo's copy3 (prompt `123=`, answer `123`). Each turn the agent sends the
conversation with one tool, `check_answer`, declared:
- if the model calls the tool (`<tool_call>{"name": "check_answer", "arguments": {"answer": "..."}}</tool_call>`,
  docs/agent.md), the agent runs it and sends the verdict back as a `tool` message;
- otherwise the text is the model's answer; a wrong answer gets the user message "wrong answer try
  again:" while turns remain.
`run` returns the copy3 reward of the last answer; the proxy gives the earlier turns that reward
discounted once per turn (`discount`).

Run it on this machine (the whole stack, with the agent in every rollout worker):

    jetrl up --config examples/agent_tool_use.yaml

`agent_tool_use.yaml` sets `rollout.workflow: services.rollout.agent:AgentWorkflow` and
`rollout.workflow_kwargs.agent: examples.agent_tool_use:ToolUseAgent`. With `mode: subprocess` the agent
runs in a process pool with OPENAI_BASE_URL set, and `SyncToolUseAgent` (blocking `OpenAI()` client)
works the same way.
"""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI, OpenAI

FEEDBACK = "wrong answer try again:"
TOOLS = [{
    "type": "function",
    "function": {
        "name": "check_answer",
        "description": "Say whether a candidate answer is right.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    },
}]


def copy3_reward(completion: str, answer: str) -> float:
    """Fraction of the answer's positions the completion gets right (the demo task's reward)."""
    return sum(1 for a, b in zip(completion, answer, strict=False) if a == b) / len(answer)


def check_answer(candidate: str, answer: str) -> str:
    """The tool: a verdict the model can read (letters only, so the tiny model's vocabulary has it)."""
    return "right" if candidate.strip() == answer else "wrong"


class ToolUseAgent:
    """The asynchronous agent (inline mode: it runs in the rollout worker's event loop)."""

    def __init__(self, max_turns: int = 2, max_tokens: int = 4, model: str = "policy") -> None:
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.model = model

    async def run(self, data: dict[str, Any], base_url: str | None = None, http_client: Any = None, **_: Any) -> float:
        # base_url None: the SDK reads OPENAI_BASE_URL, as in subprocess mode
        client = AsyncOpenAI(base_url=base_url, api_key="jetrl", http_client=http_client)
        messages: list[dict[str, Any]] = [{"role": "user", "content": str(data["prompt"])}]
        reward = 0.0
        for _turn in range(self.max_turns):
            resp = await client.chat.completions.create(model=self.model, messages=messages, tools=TOOLS, max_tokens=self.max_tokens)
            reward, done = self.step(messages, resp.choices[0].message, str(data["answer"]))
            if done:
                break
        return reward

    def step(self, messages: list[dict[str, Any]], message: Any, answer: str) -> tuple[float, bool]:
        """Record the model's turn and answer it: tool results, or feedback on a wrong answer."""
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                args = json.loads(call.function.arguments or "{}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": check_answer(str(args.get("answer", "")), answer)})
            return 0.0, False
        reward = copy3_reward(message.content or "", answer)
        if reward < 1.0:
            messages.append({"role": "user", "content": FEEDBACK})
        return reward, reward >= 1.0


class SyncToolUseAgent(ToolUseAgent):
    """The same agent with the blocking client: run it with `mode: subprocess`."""

    def run(self, data: dict[str, Any], **_: Any) -> float:  # type: ignore[override]
        client = OpenAI(api_key="jetrl")  # OPENAI_BASE_URL is the episode's proxy session
        messages: list[dict[str, Any]] = [{"role": "user", "content": str(data["prompt"])}]
        reward = 0.0
        for _turn in range(self.max_turns):
            resp = client.chat.completions.create(model=self.model, messages=messages, tools=TOOLS, max_tokens=self.max_tokens)
            reward, done = self.step(messages, resp.choices[0].message, str(data["answer"]))
            if done:
                break
        return reward
