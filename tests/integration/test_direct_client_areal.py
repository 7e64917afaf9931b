"""The direct client (`ArealOpenAI`) as AReaL's direct-client examples use it, against the CPU
inference server with the tiny model: AReaL's constructor arguments, the SDK's `ChatCompletionMessage`
appended to `messages`, `gconfig.to_openai_args_dict()` as the call's arguments, openai-agents
driving it (it passes `stream=Omit`), `get_interaction(s)` with `model_response` and `messages`, and
a second `apply_reward_discount` raising as AReaL's does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from jetrl import ArealOpenAI, GenerationHyperparameters
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import SGLangClient
from services.rollout.workflow import as_tensor_dict
from tests.integration.test_rollout_stack import inference


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with inference(tiny_model, tmp_path_factory.mktemp("inf") / "server.log") as url:
        yield url


@pytest.fixture
async def engine(server: str) -> AsyncIterator[SGLangClient]:
    eng = SGLangClient(InferenceClientSettings(servers=[server]))
    try:
        yield eng
    finally:
        await eng.aclose()


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


async def test_a_multi_turn_direct_client_episode_as_areal_writes_it(engine: SGLangClient, tokenizer: Any) -> None:
    gconfig = GenerationHyperparameters(max_new_tokens=5, temperature=1.0).new_with_stop_and_pad_token_ids(tokenizer)
    client = ArealOpenAI(engine=engine, tokenizer=tokenizer, tool_call_parser="qwen25", reasoning_parser="qwen3",
                         chat_template_type="concat", engine_max_tokens=4096)
    messages: list[Any] = [{"role": "user", "content": "What is 2 + 3?"}]
    for _ in range(2):
        completion = await client.chat.completions.create(
            messages=messages, model="default", **gconfig.to_openai_args_dict(exclude_args=["n_samples"]))
        client.set_reward(completion.id, 0.0)
        messages.append(completion.choices[0].message)  # the SDK's ChatCompletionMessage, as AReaL's example appends it
        messages.append({"role": "user", "content": "Try again."})
    client.set_last_reward(1.0)
    _first, last = list(client.get_interactions())
    assert client.get_interaction(last).model_response.output_len >= 1
    assert client.get_interaction(last).messages[-1] == {"role": "user", "content": "Try again."}
    client.apply_reward_discount(turn_discount=0.5)
    with pytest.raises(RuntimeError, match="only be called once"):
        client.apply_reward_discount(turn_discount=0.5)
    samples = client.export_interactions(style="individual")
    tensors = as_tensor_dict(samples)
    assert tensors is not None and tensors["rewards"].tolist() == pytest.approx([0.5, 1.0])


async def test_responses_validate_with_the_installed_sdk_and_omit_is_dropped(engine: SGLangClient, tokenizer: Any) -> None:
    import openai

    client = ArealOpenAI(engine=engine, tokenizer=tokenizer)
    response = await client.responses.create(model="default", input="What is 2 + 3?", max_output_tokens=4,
                                             stream=openai.omit, temperature=openai.NOT_GIVEN)
    assert response.usage is not None and response.usage.output_tokens >= 1  # the SDK's own type validated


async def test_openai_agents_drive_the_direct_client(engine: SGLangClient, tokenizer: Any) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner

    client = ArealOpenAI(engine=engine, tokenizer=tokenizer)
    gconfig = GenerationHyperparameters(max_new_tokens=5)
    agent = Agent(name="math", instructions="Answer briefly.",
                  model=OpenAIChatCompletionsModel(model="default", openai_client=client))  # type: ignore[arg-type]
    settings = ModelSettings(**gconfig.to_openai_agents_model_settings_dict(exclude_args=["n_samples"]))
    result = await Runner.run(agent, input="What is 2 + 3?", run_config=RunConfig(tracing_disabled=True, model_settings=settings))
    assert isinstance(result.final_output, str)
    client.set_last_reward(1.0)
    client.apply_reward_discount(turn_discount=0.9)
    samples = client.export_interactions(style="individual")
    assert len(samples) == 1 and as_tensor_dict(samples) is not None
