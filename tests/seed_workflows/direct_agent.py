"""The agent-workflow reference's direct approach: an `ArealOpenAI` client bound to the engine,
rewards set on the client, the discount applied, the interactions exported."""

# the seed: from areal.api.workflow_api import RolloutWorkflow; from areal.experimental.openai import ArealOpenAI
from jetrl import ArealOpenAI, RolloutWorkflow
from tests.seed_workflows.rewards import copy3_reward_fn


def compute_reward(response, answer):
    return copy3_reward_fn("", response.choices[0].message.content or "", [], [], answer=answer)


class MyWorkflow(RolloutWorkflow):
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def arun_episode(self, engine, data):
        # Create client bound to engine
        client = ArealOpenAI(engine=engine, tokenizer=self.tokenizer)

        # Use like standard OpenAI client
        response = await client.chat.completions.create(
            model="default",
            messages=data["messages"],
        )

        # Set reward and export
        reward = compute_reward(response, data["answer"])
        client.set_last_reward(reward)
        client.apply_reward_discount(turn_discount=0.9)

        return client.export_interactions(style="individual")
