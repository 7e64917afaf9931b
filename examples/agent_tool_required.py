"""A tool-using agent whose every tool call is valid: `tool_choice="required"` with the official `openai`
SDK, enforced while decoding by the inference server (docs/agent.md, "tool_choice and response_format").

The task is the copy3 demo's (prompt `123=`, answer `123`). The agent offers one tool, `submit(answer)`,
and requires a call: the server's grammar holds the completion to `{"name": "submit", "arguments":
{"answer": "<1 to 8 digits>"}}`, so the SDK always returns one well-formed call (never a 422
for a malformed one, whatever the policy's state: an untrained or a freshly updated model alike) and
the reward is copy3's on the submitted answer. What the trainer sees are the tokens sampled under the
grammar, with the log-probs of the constrained distribution.

Run it (the model must spell JSON; `jetrl up` keeps the servers' tokenizer, which the grammar needs,
because the workflow is an agent):

    jetrl make-model --vocab ascii --out .jetrl/models/ascii
    jetrl up --config examples/agent_tool_required.yaml

or on a real model, SmolLM2-135M-Instruct:

    jetrl make-model smollm2-135m-instruct
    jetrl up --config examples/agent_tool_required_smollm2.yaml
"""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

SUBMIT = {
    "type": "function",
    "function": {
        "name": "submit",
        "description": "Submit the final answer.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string", "pattern": "^[0-9]{1,8}$"}},
                       "required": ["answer"], "additionalProperties": False},
    },
}


def copy3_reward(completion: str, answer: str) -> float:
    """Fraction of the answer's positions the completion gets right (the demo task's reward)."""
    return sum(1 for a, b in zip(completion, answer, strict=False) if a == b) / len(answer)


class RequiredToolAgent:
    """One turn: the model must call `submit`; the reward is copy3's on its argument."""

    def __init__(self, max_tokens: int = 200, model: str = "policy", seed: int | None = None) -> None:
        self.max_tokens = max_tokens
        self.model = model
        self.seed = seed

    async def run(self, data: dict[str, Any], base_url: str | None = None, http_client: Any = None, **_: Any) -> float:
        client = AsyncOpenAI(base_url=base_url, api_key="jetrl", http_client=http_client)
        resp = await client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": str(data["prompt"])}], tools=[SUBMIT],
            tool_choice="required", max_tokens=self.max_tokens, seed=self.seed)
        [call] = resp.choices[0].message.tool_calls or []  # exactly one valid call, every time
        args = json.loads(call.function.arguments)  # type: ignore[union-attr]
        return copy3_reward(str(args["answer"]), str(data["answer"]))
