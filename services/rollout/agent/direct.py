"""`ArealOpenAI`: AReaL's direct client. An OpenAI-style client bound to the episode's inference
engine, for a `RolloutWorkflow` that drives the conversation itself:

    client = ArealOpenAI(engine=engine, tokenizer=self.tokenizer)
    response = await client.chat.completions.create(model="default", messages=data["messages"])
    client.set_last_reward(reward)
    client.apply_reward_discount(turn_discount=0.9)
    return client.export_interactions(style="individual")

No HTTP: each call goes straight to the proxy's core (`AgentProxy.complete`), so a completion is
recorded exactly as through the proxy: same canonical requests, same interaction tree (parents by
message prefix), same rewards, discounted returns and export styles, same token ids, logprobs and
versions as the engine generated them. Replies are the OpenAI SDK's own types (`ChatCompletion`,
`Response`), parsed from the proxy's reply bodies.

Rewards: until `apply_reward_discount` is called, each interaction keeps only its own reward (as in
AReaL, where the discount pass is what propagates a reward back to earlier turns).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from services.rollout.agent import replies
from services.rollout.agent.errors import ProxyError
from services.rollout.agent.export import AgentSample
from services.rollout.agent.proxy import AgentProxy, SamplingDefaults
from services.rollout.agent.requests import CanonicalRequest, parse_chat, parse_responses
from services.rollout.engine import InferenceError
from services.rollout.workflow import WorkflowError, workflow_context


class _Completions:
    def __init__(self, create: Callable[..., Awaitable[Any]]) -> None:
        self.create = create


class _Chat:
    def __init__(self, create: Callable[..., Awaitable[Any]]) -> None:
        self.completions = _Completions(create)


class _Responses:
    def __init__(self, create: Callable[..., Awaitable[Any]]) -> None:
        self.create = create


def _body(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The request body an OpenAI SDK call would send: unset (None / NOT_GIVEN) arguments dropped."""
    return {k: v for k, v in kwargs.items() if v is not None and type(v).__name__ != "NotGiven"}


class ArealOpenAI:
    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> None:
        """`tokenizer`: a tokenizer object or a model directory; the sampling settings are what a
        call that does not say gets."""
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        if tokenizer is None:
            raise WorkflowError("ArealOpenAI needs a tokenizer (an object or a model directory)")
        self.proxy = AgentProxy(engine, tokenizer, SamplingDefaults(max_new_tokens, temperature, top_p))
        self.session = self.proxy.start_session(workflow_context.task_id)
        self.discount = 0.0
        self.chat = _Chat(self._chat)
        self.responses = _Responses(self._responses)

    # ---- the OpenAI surface --------------------------------------------------------------------
    async def _chat(self, **kwargs: Any) -> Any:
        from openai.types.chat import ChatCompletion

        parsed = self._parse(parse_chat, kwargs, "chat.completions.create")
        item = await self._complete(parsed, "chat")
        return ChatCompletion.model_validate(replies.chat_completion([item], parsed, self.proxy.chat))

    async def _responses(self, **kwargs: Any) -> Any:
        from openai.types.responses import Response

        parsed = self._parse(parse_responses, kwargs, "responses.create")
        item = await self._complete(parsed, "responses")
        return Response.model_validate(replies.response(item, parsed, self.proxy.chat))

    @staticmethod
    def _parse(parse: Callable[[Any], CanonicalRequest], kwargs: dict[str, Any], call: str) -> CanonicalRequest:
        try:
            return parse(_body(kwargs))
        except ProxyError as exc:
            raise WorkflowError(f"ArealOpenAI.{call}: {exc.message}") from exc

    async def _complete(self, parsed: CanonicalRequest, api: str) -> Any:
        try:
            return await self.proxy.complete(self.session.id, parsed, api)
        except ProxyError as exc:
            if exc.status < 500:  # the request is wrong: retrying the episode cannot help
                raise WorkflowError(f"ArealOpenAI: {exc.message}") from exc
            raise InferenceError(exc.message) from exc

    # ---- rewards and export --------------------------------------------------------------------
    def _reward(self, reward: float, completion_id: str | None) -> None:
        try:
            self.proxy.set_reward(self.session.id, reward, completion_id)
        except ProxyError as exc:
            raise WorkflowError(f"ArealOpenAI reward: {exc.message}") from exc

    def set_reward(self, completion_id: str, reward: float) -> None:
        """Reward one completion (its `id`)."""
        self._reward(reward, completion_id)

    def set_last_reward(self, reward: float) -> None:
        """Reward the latest completion."""
        self._reward(reward, None)

    def apply_reward_discount(self, turn_discount: float = 1.0) -> None:
        """Propagate rewards back through the conversation tree: a completion's return is its own
        reward plus `turn_discount` times its children's (mean) return."""
        if not 0.0 <= turn_discount <= 1.0:
            raise WorkflowError(f"turn_discount must be in [0, 1], got {turn_discount}")
        self.discount = turn_discount

    def export_interactions(self, style: str = "individual") -> dict[str, AgentSample]:
        """Completion id -> training sample ("individual": one per completion; "concat": one per
        conversation leaf), the dict of interactions `arun_episode` returns. The session ends here."""
        try:
            return self.proxy.export(self.session.id, self.discount, style)
        except ProxyError as exc:
            raise WorkflowError(f"ArealOpenAI.export_interactions: {exc.message}") from exc

    @property
    def interactions(self) -> int:
        """Completions recorded so far."""
        return len(self.session.cache)
