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
from services.rollout.agent.cache import DISCOUNT_RULES
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


_UNSET = ("NotGiven", "Omit")
"""The SDKs' markers of an argument not given (openai-agents passes `stream=Omit`)."""


def _plain(value: Any) -> Any:
    """SDK objects (`ChatCompletionMessage` appended to `messages`, ...) as the JSON the SDK would send."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True, mode="json")
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if type(v).__name__ not in _UNSET}
    return value


def _body(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The request body an OpenAI SDK call would send: unset (None / NOT_GIVEN / Omit) arguments
    dropped, SDK objects as their JSON."""
    return {k: _plain(v) for k, v in kwargs.items() if v is not None and type(v).__name__ not in _UNSET}


class ArealOpenAI:
    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        tool_call_parser: str = "qwen",
        reasoning_parser: str = "qwen3",
        engine_max_tokens: int | None = None,
        chat_template_type: str = "hf",
        lora_name: str = "",
        *,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        discount_rule: str = "tree",
        **kwargs: Any,
    ) -> None:
        """`tokenizer`: a tokenizer object or a model directory; the sampling settings are what a
        call that does not say gets. `discount_rule`: how `apply_reward_discount` propagates rewards,
        "tree" (jetrl's: through the conversation tree, children averaged) or "creation_order"
        (AReaL's: linear, back through the completions in the order they were made).

        AReaL's constructor arguments are accepted: `engine_max_tokens` caps prompt + completion of a
        call; `chat_template_type` "hf" (the tokenizer's template, AReaL's default) or "concat" (both
        render with the tokenizer's template here: jetrl's prompts are always the template's tokens,
        and a continuation that extends its parent's exact tokens is detected by itself);
        `tool_call_parser` / `reasoning_parser` name AReaL's server-side parsers: jetrl parses tool
        calls in the client's own format (docs/agent.md) and keeps reasoning in the text, so they
        are recorded and change nothing; `lora_name` must be "" (no LoRA serving); other keyword
        arguments (an OpenAI client's `api_key`, `base_url`, ...) are ignored, there being no HTTP."""
        if lora_name:
            raise WorkflowError(f"ArealOpenAI(lora_name={lora_name!r}): jetrl's inference servers serve no LoRA adapters")
        if chat_template_type not in ("hf", "concat"):
            raise WorkflowError(f"ArealOpenAI: chat_template_type must be 'hf' or 'concat', got {chat_template_type!r}")
        if discount_rule not in DISCOUNT_RULES:
            raise WorkflowError(f"ArealOpenAI: discount_rule must be one of {DISCOUNT_RULES}, got {discount_rule!r}")
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.chat_template_type = chat_template_type
        self.engine_max_tokens = engine_max_tokens
        self.discount_rule = discount_rule
        self._discounted = False
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        if tokenizer is None:
            raise WorkflowError("ArealOpenAI needs a tokenizer (an object or a model directory)")
        self.proxy = AgentProxy(engine, tokenizer, SamplingDefaults(max_new_tokens, temperature, top_p))
        self.session = self.proxy.start_session(workflow_context.prompt_id)
        self.discount = 0.0
        # what SDK wrappers (openai-agents) read off an OpenAI client: no HTTP happens here
        import httpx

        self.base_url = httpx.URL("http://jetrl-direct-client/v1/")
        self.websocket_base_url: str | None = None
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
        body = replies.response(item, parsed, self.proxy.chat)
        # AReaL's client reports every response `completed` (a cut one too; the cut stays in the
        # interaction's stop reason): openai-agents raises on an `incomplete` one, which would fail
        # every episode whose turn reaches `max_output_tokens`. The proxy answers as OpenAI does.
        body.update(status="completed", incomplete_details=None)
        return Response.model_validate(body)

    def _parse(self, parse: Callable[[Any], CanonicalRequest], kwargs: dict[str, Any], call: str) -> CanonicalRequest:
        try:
            parsed = parse(_body(kwargs))
        except ProxyError as exc:
            raise WorkflowError(f"ArealOpenAI.{call}: {exc.message}") from exc
        return self._capped(parsed)

    def _capped(self, parsed: CanonicalRequest) -> CanonicalRequest:
        """`engine_max_tokens` caps prompt + completion, as AReaL's client caps them."""
        if self.engine_max_tokens is None:
            return parsed
        import dataclasses

        prompt = len(self.proxy.chat.prompt_ids(parsed.messages, parsed.tools, None)[0])
        room = max(1, self.engine_max_tokens - prompt)
        current = getattr(parsed, "max_new_tokens", None)
        if current is None or current > room:
            return dataclasses.replace(parsed, max_new_tokens=room)
        return parsed

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
        """Propagate rewards back to earlier completions by `discount_rule`: through the conversation
        tree (a completion's return is its own reward plus `turn_discount` times its children's mean
        return) or AReaL's creation order. A second call raises, as AReaL's does (the first would
        otherwise be silently replaced)."""
        if self._discounted:
            raise RuntimeError("apply_reward_discount should only be called once.")
        if not 0.0 <= turn_discount <= 1.0:
            raise WorkflowError(f"turn_discount must be in [0, 1], got {turn_discount}")
        self._discounted = True
        self.discount = turn_discount

    def get_interaction(self, id: str) -> Any:
        """The completion `id` with its `reward`, `messages` (the request's) and `model_response`
        (token ids, logprobs, versions), or None."""
        return self.session.cache.get(id)

    def get_interactions(self) -> dict[str, Any]:
        """Every completion so far by id, in creation order."""
        return {i.id: i for i in self.session.cache.values()}

    def export_interactions(self, style: str = "individual") -> dict[str, AgentSample]:
        """Completion id -> training sample ("individual": one per completion; "concat": one per
        conversation leaf), the dict of interactions `arun_episode` returns. The session ends here."""
        try:
            return self.proxy.export(self.session.id, self.discount, style, self.discount_rule)
        except ProxyError as exc:
            raise WorkflowError(f"ArealOpenAI.export_interactions: {exc.message}") from exc

    @property
    def interactions(self) -> int:
        """Completions recorded so far."""
        return len(self.session.cache)
