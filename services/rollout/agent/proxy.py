"""The proxy's core, without HTTP: sessions, one recorded completion per request, rewards, export.

A session is one agent episode. Each completion is generated from token ids (`InferenceEngine.agenerate`)
and cached with the exact prompt ids, output ids, logprobs and per-token weight versions the engine
reported; the text answered to the agent is decoded from those ids, and nothing is ever tokenized back
from it. The requests of a session stick to one inference server (`episode=session id`), so a
conversation's growing prefix stays in that server's cache.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from services.common.logging import get_logger
from services.rollout.agent.cache import Interaction, InteractionCache
from services.rollout.agent.chat import ChatTokenizer
from services.rollout.agent.constraints import output_constraint
from services.rollout.agent.errors import ProxyError, bad_request, not_found
from services.rollout.agent.export import STYLES, AgentSample, ExportError, export_session
from services.rollout.agent.options import unmet
from services.rollout.agent.requests import CanonicalRequest, Message
from services.rollout.agent.stops import cut_at_stop
from services.rollout.agent.toolcalls import ToolCall, parse_tool_calls
from services.rollout.engine import BadRequestError, InferenceError, ModelRequest, ModelResponse

log = get_logger("rollout.agent")

ID_PREFIX = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_", "completions": "cmpl-"}


@dataclass
class Prompt:
    """What a request is generated from: its messages (with the continued response's, if any), the
    interaction it continues, the prompt ids and the text that opens the assistant's turn."""

    messages: list[Message]
    parent: Interaction | None
    ids: list[int]
    incremental: bool
    prefill: str


@dataclass
class SamplingDefaults:
    """What a request that does not say gets."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class Session:
    id: str
    task_id: str | None = None
    cache: InteractionCache = field(default_factory=InteractionCache)
    ended: bool = False
    started: float = field(default_factory=time.monotonic)
    stored: dict[str, CanonicalRequest] = field(default_factory=dict)
    """The request of each stored Responses API response (`store`, default true), for `GET .../responses/{id}`."""


@dataclass
class ProxyStats:
    sessions_started: int = 0
    completions: int = 0
    completion_tokens: int = 0
    errors: int = 0
    stop_trimmed_tokens: int = 0
    """Tokens generated after a stop string, dropped from the record (never answered, never trained)."""
    unmet: int = 0
    """Completions that missed their tool_choice / response_format (recorded, answered 422)."""


class AgentProxy:
    def __init__(self, engine: Any, tokenizer: Any, defaults: SamplingDefaults | None = None) -> None:
        self.engine = engine
        self.chat = ChatTokenizer(tokenizer)
        self.defaults = defaults or SamplingDefaults()
        self.sessions: dict[str, Session] = {}
        self.stats = ProxyStats()

    # ---- sessions ------------------------------------------------------------------------------
    def start_session(self, task_id: str | None = None) -> Session:
        session = Session(id=uuid.uuid4().hex, task_id=task_id)
        self.sessions[session.id] = session
        self.stats.sessions_started += 1
        return session

    def session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise not_found(f"unknown session {session_id!r}: start one with POST /rl/start_session", "session_not_found")
        return session

    def end_session(self, session_id: str) -> Session:
        session = self.session(session_id)
        session.ended = True
        return session

    def drop_session(self, session_id: str) -> None:
        if self.sessions.pop(session_id, None) is not None and hasattr(self.engine, "release_episode"):
            self.engine.release_episode(session_id)

    # ---- completions ---------------------------------------------------------------------------
    def _prompt(self, session: Session, request: CanonicalRequest) -> Prompt:
        if request.raw_prompt is not None:  # /v1/completions: the text as it is, no template, no parent
            return Prompt(request.messages, None, list(self.chat.tokenizer(request.raw_prompt).input_ids), False, "")
        messages = request.messages
        if request.previous_id is not None:
            previous = session.cache.get(request.previous_id)
            if previous is None:
                raise not_found(
                    f"previous_response_id {request.previous_id!r} is not a response of this session",
                    "previous_response_not_found",
                )
            messages = previous.conversation + messages
        parent = session.cache.find_parent(messages)
        # tool_choice "none": the model is not told about the tools at all
        tools = None if request.tool_choice.mode == "none" else request.tools
        ids, incremental = self.chat.prompt_ids(messages, tools, parent)
        prefill = request.tool_choice.prefill()
        return Prompt(messages, parent, ids + self.chat.encode(prefill), incremental, prefill)

    def count_tokens(self, session_id: str, request: CanonicalRequest) -> int:
        """The prompt tokens a completion of `request` would get now (Anthropic `count_tokens`)."""
        return len(self._prompt(self.session(session_id), request).ids)

    async def complete(self, session_id: str, request: CanonicalRequest, api: str) -> Interaction:
        """One recorded completion (`request.n` must be 1; `complete_n` records several)."""
        if request.n != 1:
            raise bad_request(f"complete() records one completion; n={request.n} needs complete_n()", "n")
        [item] = await self.complete_n(session_id, request, api)
        return item

    async def complete_n(self, session_id: str, request: CanonicalRequest, api: str) -> list[Interaction]:
        """`request.n` completions of one prompt, each recorded as its own interaction (siblings):
        the first gets the reply's id, the i-th `{id}-{i}`."""
        session = self.session(session_id)
        if session.ended:
            raise ProxyError(409, f"session {session_id} has ended; start a new one", code="session_ended")
        constraint = output_constraint(request.tools, request.tool_choice, request.response_format)
        prompt = self._prompt(session, request)
        model_request = ModelRequest(
            input_ids=prompt.ids,
            max_new_tokens=request.max_new_tokens or self.defaults.max_new_tokens,
            temperature=self.defaults.temperature if request.temperature is None else request.temperature,
            top_p=self.defaults.top_p if request.top_p is None else request.top_p,
            top_k=request.top_k or -1,
            stop=list(request.stop),
            seed=request.seed,
            top_logprobs=request.top_logprobs if request.logprobs else 0,
            json_schema=constraint,
            frequency_penalty=request.frequency_penalty,
            presence_penalty=request.presence_penalty,
            logit_bias=dict(request.logit_bias),
        )
        # n samples of one prompt; a given seed is varied per sample or they would all be the same
        samples = [replace(model_request, seed=None if request.seed is None else request.seed + i) for i in range(request.n)]
        try:
            resps = await asyncio.gather(*(self.engine.agenerate(r, episode=session_id) for r in samples))
        except BadRequestError as exc:
            self.stats.errors += 1
            raise bad_request(f"the inference server refused the request: {exc}") from exc
        except InferenceError as exc:
            self.stats.errors += 1
            raise ProxyError(503, f"inference failed: {exc}", code="inference_unavailable") from exc
        base = ID_PREFIX[api] + uuid.uuid4().hex[:24]
        items = [self._record(session, api, base if i == 0 else f"{base}-{i}", prompt, request, r) for i, r in enumerate(resps)]
        failed = [(item, why) for item, why in items if why is not None]
        if failed:
            self.stats.unmet += len(failed)
            why = "; ".join(f"completion {item.id}: {reason}" for item, reason in failed)
            log.info("completion missed its constraint", session=session_id, reason=why)
            raise ProxyError(422, f"{why} (recorded: it can be rewarded and is exported)", code="constraint_unmet")
        return [item for item, _ in items]

    def _record(self, session: Session, api: str, interaction_id: str, prompt: Prompt, request: CanonicalRequest,
                resp: ModelResponse) -> tuple[Interaction, str | None]:
        """Cache one engine completion (cut at its first stop string); returns it and why it misses
        the request's tool_choice / response_format (None when it does not)."""
        cut = cut_at_stop(list(resp.output_ids), request.stop, self.chat.decode)
        if cut.keep < len(resp.output_ids):
            self.stats.stop_trimmed_tokens += len(resp.output_ids) - cut.keep
            log.debug("tokens after a stop string dropped", interaction=interaction_id, tokens=len(resp.output_ids) - cut.keep)
        text = prompt.prefill + cut.text
        calls: list[ToolCall] = []
        if request.tool_choice.mode == "none":
            content = text
        else:
            content, calls = parse_tool_calls(text, id_prefix=f"call_{interaction_id[-12:]}")
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = [c.openai() for c in calls]
        interaction = Interaction(
            id=interaction_id, api=api, messages=prompt.messages, reply=reply,
            prompt_ids=list(resp.input_ids), output_ids=list(resp.output_ids[: cut.keep]),
            output_logprobs=list(resp.output_logprobs[: cut.keep]), output_versions=list(resp.output_versions[: cut.keep]),
            output_top_logprobs=list(resp.output_top_logprobs[: cut.keep]),
            stop_reason="stop" if cut.matched is not None else resp.stop_reason, stop_sequence=cut.matched,
            incremental=prompt.incremental, parent=prompt.parent,
        )
        session.cache.add(interaction)
        self.stats.completions += 1
        self.stats.completion_tokens += len(interaction.output_ids)
        why = unmet(content, calls, request.tools, request.tool_choice, request.response_format)
        if why is not None and interaction.stop_reason == "length":
            why += f" (cut by max_tokens after {len(interaction.output_ids)} tokens)"
        return interaction, why

    # ---- rewards and export --------------------------------------------------------------------
    def set_reward(self, session_id: str, reward: Any, interaction_id: str | None = None) -> Interaction:
        session = self.session(session_id)
        try:
            return session.cache.set_reward(reward, interaction_id)
        except ValueError as exc:
            raise bad_request(str(exc), "reward") from exc
        except KeyError as exc:
            raise not_found(str(exc.args[0]), "interaction_not_found") from exc
        except LookupError as exc:
            raise bad_request(str(exc)) from exc

    def export(self, session_id: str, discount: float = 1.0, style: str = "individual",
               rule: str = "tree") -> dict[str, AgentSample]:
        """The session's samples (completion id -> sample); the session is closed and forgotten.
        `rule`: how rewards propagate back ("tree" or AReaL's "creation_order", `cache.returns`)."""
        session = self.session(session_id)
        if style not in STYLES:
            raise bad_request(f"style must be one of {', '.join(STYLES)}, got {style!r}", "style")
        if not 0.0 <= discount <= 1.0:
            raise bad_request(f"discount must be in [0, 1], got {discount}", "discount")
        try:
            samples = export_session(session.cache, discount, style, rule)
        except ExportError as exc:
            raise bad_request(str(exc), "style") from exc
        self.drop_session(session_id)
        return samples
