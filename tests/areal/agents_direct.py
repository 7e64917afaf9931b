"""The one piece of the AReaL tier that is not AReaL's file: the workflow that runs an openai-agents
agent through the direct client.

AReaL keeps that workflow in `examples/openai-agents/` of its repository, and `examples/` is in
neither distribution on PyPI (the `areal` 1.0.4 wheel nor its sdist; 1.0.4 is the only version there).
What PyPI does have is the agent those examples train, `areal/workflow/openai_agent/math_agent.py`
(`build_math_agent()`: an openai-agents `Agent` that hands off to four specialists), and the tier
ports that file unchanged but for its imports. This module is the example's shape around it, written
as a user would write it in jetrl (names from `jetrl`, as docs/compat.md maps AReaL's): build the
agent from `agent_builder_path`, run it with `Runner.run` on an `OpenAIProvider` whose client is
`ArealOpenAI`, score the final output with the reward function, record it with `stats_tracker`,
discount, export the interactions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jetrl import (
    ArealOpenAI,
    AsyncRewardWrapper,
    GenerationHyperparameters,
    InferenceEngine,
    RolloutWorkflow,
    import_from_string,
    stats_tracker,
    workflow_context,
)


class OpenAIAgentsWorkflow(RolloutWorkflow):
    def __init__(
        self,
        agent_builder_path: str,
        reward_fn: Callable[..., Any],
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        turn_discount: float = 0.9,
    ) -> None:
        self.agent_builder = import_from_string(agent_builder_path)
        self.async_reward_fn = AsyncRewardWrapper(reward_fn)
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        self.tokenizer = tokenizer
        self.turn_discount = turn_discount

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Any]:
        from agents import ModelSettings, OpenAIProvider, RunConfig, Runner

        client = ArealOpenAI(engine=engine, tokenizer=self.tokenizer)
        run_config = RunConfig(
            model_provider=OpenAIProvider(openai_client=client),  # type: ignore[arg-type]
            tracing_disabled=True,
            model_settings=ModelSettings(**self.gconfig.to_openai_agents_model_settings_dict(exclude_args=["n_samples"])),
        )
        content = data["messages"][-1]["content"]
        result = await Runner.run(self.agent_builder(), input=content, run_config=run_config)
        reward = await self.async_reward_fn(content, str(result.final_output), [], [], **data)
        stats_tracker.get(workflow_context.stat_scope()).scalar(reward=reward, num_interactions=client.interactions)
        client.set_last_reward(reward)
        client.apply_reward_discount(turn_discount=self.turn_discount)
        return client.export_interactions(style="individual")
