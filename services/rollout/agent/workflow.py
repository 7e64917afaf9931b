"""`AgentWorkflow`: any agent with `async def run(data, **extra_kwargs)` as a rollout workflow.

Each episode opens a proxy session, runs the agent against it, applies what `run` returned as
rewards, and exports the session's completions as training samples (a dict of interactions, which
the worker turns into a tensor dict). The proxy server starts with the first episode, inside the
worker's event loop, and serves every episode of this worker.

- `mode="inline"`: `await agent.run(data, base_url=<session>, api_key=<session key>, http_client=<client>)`
  in the worker's loop, as AReaL calls it (each only if `run` accepts it); the agent builds
  `AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)` or
  `AsyncAnthropic(...)` alike: the session's root serves the OpenAI routes and Anthropic's
  `/v1/messages`. `http_client` is an `httpx.AsyncClient`, or an `httpx2.AsyncClient` (anthropic's
  own kind) for an agent whose module uses anthropic and not openai (`http_client_kind`).
- `mode="subproc"` (AReaL's name; "subprocess" is accepted too): the agent runs in a process pool
  with `OPENAI_BASE_URL`/`OPENAI_API_KEY` (and `ANTHROPIC_BASE_URL`/`ANTHROPIC_API_KEY`) set to its
  session, so blocking code (`OpenAI()`) works; `run` may then be synchronous. The agent must be importable ("module:Class") or picklable.

`run` returns a float (the reward of the session's last completion), a dict of completion id ->
reward, or None when it set its rewards itself through `POST /{session}/rl/set_reward`. An episode
with no reward at all is an error, never a silent 0.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Mapping
from typing import Any

from services.common.logging import get_logger
from services.rollout.agent.cache import DISCOUNT_RULES
from services.rollout.agent.errors import ProxyError
from services.rollout.agent.export import STYLES, AgentSample
from services.rollout.agent.proxy import AgentProxy, SamplingDefaults, Session
from services.rollout.agent.server import ProxyServer
from services.rollout.compat import stats_tracker
from services.rollout.engine_api import InferenceEngine
from services.rollout.workflow import RolloutWorkflow, WorkflowError, import_ref, workflow_context

log = get_logger("rollout.agent")

MODES = ("inline", "subproc")
#: other spellings of a mode
MODE_ALIASES = {"subprocess": "subproc"}


class AgentWorkflow(RolloutWorkflow):
    needs_grammar = True
    """The proxy turns `response_format` / `tool_choice` required or named into grammars."""

    def __init__(
        self,
        agent: Any,
        tokenizer: Any = None,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        mode: str = "inline",
        discount: float = 1.0,
        export_style: str = "individual",
        discount_rule: str = "tree",
        agent_kwargs: Mapping[str, Any] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 4,
        timeout_s: float = 600.0,
    ) -> None:
        """`agent`: an object, a class (built with `agent_kwargs`) or a "module:Name" reference;
        `tokenizer`: a tokenizer or model directory (default: the inference server's, from
        /model_info); `discount`: reward discount per turn back through the conversation tree;
        `export_style`: "individual" or "concat"; `discount_rule`: "tree" (jetrl's: back through the
        conversation tree, continuations averaged) or "creation_order" (AReaL's: linear, back through
        the completions in the order they were made); `host`/`port`: where the proxy listens (0: a free
        port); `max_workers`: subprocess-mode pool size; `timeout_s`: longest episode.

        Numbers may arrive as strings and `agent_kwargs` as JSON text: `jetrl up` hands
        workflow_kwargs to the worker through environment variables."""
        try:
            max_new_tokens, max_workers, port = int(max_new_tokens), int(max_workers), int(port)
            temperature, top_p, discount, timeout_s = float(temperature), float(top_p), float(discount), float(timeout_s)
        except (TypeError, ValueError) as exc:
            raise WorkflowError(f"agent workflow: a numeric setting is not a number: {exc}") from exc
        if isinstance(agent_kwargs, str):
            agent_kwargs = json.loads(agent_kwargs)
        mode = MODE_ALIASES.get(mode, mode)
        if mode not in MODES:
            raise WorkflowError(f"agent mode must be one of {MODES}, got {mode!r}")
        if export_style not in STYLES:
            raise WorkflowError(f"export_style must be one of {STYLES}, got {export_style!r}")
        if discount_rule not in DISCOUNT_RULES:
            raise WorkflowError(f"discount_rule must be one of {DISCOUNT_RULES}, got {discount_rule!r}")
        self.discount_rule = discount_rule
        if not 0.0 <= discount <= 1.0:
            raise WorkflowError(f"discount must be in [0, 1], got {discount}")
        if max_workers < 1 or timeout_s <= 0 or max_new_tokens < 1:
            raise WorkflowError("max_workers and max_new_tokens must be >= 1 and timeout_s > 0")
        self.mode = mode
        self.agent_kwargs = dict(agent_kwargs or {})
        self.agent_spec = agent  # what a subprocess imports or unpickles
        self.agent = self._build_agent(agent)
        self.tokenizer = tokenizer
        self.defaults = SamplingDefaults(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        self.discount = discount
        self.export_style = export_style
        self.host, self.port = host, port
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.proxy: AgentProxy | None = None
        self.server: ProxyServer | None = None
        self._http: Any = None
        self._pool: Any = None
        self._lock = asyncio.Lock()

    def _build_agent(self, spec: Any) -> Any:
        obj = import_ref(spec) if isinstance(spec, str) else spec
        run = getattr(obj, "run", None)
        if run is None:
            raise WorkflowError(f"agent {spec!r} has no run(data, **extra_kwargs) method")
        if self.mode == "inline" and not inspect.iscoroutinefunction(run):
            raise WorkflowError(f"agent {spec!r}: inline mode needs `async def run`; use mode='subproc' for synchronous agents")
        if self.mode == "subproc":
            return None  # built in the pool processes
        if isinstance(obj, type):
            try:
                return obj(**self.agent_kwargs)
            except TypeError as exc:
                raise WorkflowError(f"agent {spec!r}: bad agent_kwargs {sorted(self.agent_kwargs)}: {exc}") from exc
        if self.agent_kwargs:
            raise WorkflowError(f"agent {spec!r} is already an object; agent_kwargs {sorted(self.agent_kwargs)} cannot apply")
        return obj

    # ---- the proxy -----------------------------------------------------------------------------
    async def start(self, engine: Any) -> ProxyServer:
        """Start the proxy (once) for `engine`; later episodes reuse it."""
        async with self._lock:
            if self.server is not None and self.proxy is not None:
                self.proxy.engine = engine
                return self.server
            tokenizer = await _load_tokenizer(self.tokenizer, engine)
            self.proxy = AgentProxy(engine, tokenizer, self.defaults)
            server = ProxyServer(self.proxy, self.host, self.port)
            await server.start()
            self.server = server
            return server

    async def _client(self) -> Any:
        """The http client agents get: httpx's, or httpx2's for an agent written against anthropic
        (anthropic >= 2.14 refuses an httpx client); made once, closed with the workflow."""
        if self._http is None:
            module = __import__("httpx2" if http_client_kind(self.agent) == "httpx2" else "httpx")
            self._http = module.AsyncClient(timeout=module.Timeout(self.timeout_s, connect=10.0))
        return self._http

    async def aclose(self) -> None:
        if self.server is not None:
            await self.server.aclose()
            self.server = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._pool is not None:
            self._pool.stop()
            self._pool = None

    # ---- one episode ---------------------------------------------------------------------------
    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, AgentSample] | None:
        server = await self.start(engine)
        proxy = self.proxy
        assert proxy is not None
        session = proxy.start_session(workflow_context.prompt_id)
        try:
            result = await self._run(server, session, data)
            self._apply(proxy, session, result)
            if not len(session.cache):
                log.warning("agent made no completion; episode rejected", task_id=session.task_id)
                return None
            if not session.cache.has_rewards():
                raise WorkflowError("the agent returned no reward and set none (return a float or a dict of completion id -> reward)")
            try:
                samples = proxy.export(session.id, self.discount, self.export_style, self.discount_rule)
            except ProxyError as exc:
                raise WorkflowError(f"agent episode cannot be exported: {exc.message}") from exc
            if samples:  # as AReaL's proxy workflow records it: the last sample's reward, in the episode's scope
                stats_tracker.get(workflow_context.stat_scope()).scalar(reward=list(samples.values())[-1].reward)
            return samples
        finally:
            proxy.drop_session(session.id)

    async def _run(self, server: ProxyServer, session: Session, data: dict[str, Any]) -> Any:
        base_url = server.base_url(session.id)
        if self.mode == "inline":
            extra = {"base_url": server.session_url(session.id), "api_key": f"jetrl-session-{session.id}",
                     "http_client": await self._client()}
            accepted = _accepted(self.agent.run, extra)
            return await asyncio.wait_for(self.agent.run(data, **accepted), self.timeout_s)
        from services.rollout.agent.child import run_agent

        future = self._process_pool().schedule(
            run_agent, args=(self.agent_spec, self.agent_kwargs, data, base_url, f"{server.url}/{session.id}"), timeout=self.timeout_s
        )
        return await asyncio.wrap_future(future)

    def _process_pool(self) -> Any:
        if self._pool is None:
            import multiprocessing

            from pebble import ProcessPool

            # spawn: the worker holds threads and sockets that a forked child must not inherit
            self._pool = ProcessPool(max_workers=self.max_workers, context=multiprocessing.get_context("spawn"))
        return self._pool

    @staticmethod
    def _apply(proxy: AgentProxy, session: Session, result: Any) -> None:
        if result is None:
            return
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            if not len(session.cache):
                raise WorkflowError(f"the agent returned reward {result} but made no completion")
            proxy.set_reward(session.id, float(result))
            return
        if isinstance(result, Mapping):
            for interaction_id, reward in result.items():
                if str(interaction_id) not in session.cache:
                    raise WorkflowError(f"the agent rewarded completion {interaction_id!r}, which is not one of this episode's")
                try:
                    proxy.set_reward(session.id, reward, str(interaction_id))
                except ProxyError as exc:
                    raise WorkflowError(f"the agent's reward for {interaction_id!r}: {exc.message}") from exc
            return
        raise WorkflowError(
            f"the agent's run returned {type(result).__name__}; expected a float, a dict of completion id -> reward, or None"
        )


def http_client_kind(agent: Any) -> str:
    """"httpx2" for an agent whose module imports anthropic and not openai, else "httpx"."""
    import sys

    module = sys.modules.get(getattr(type(agent) if not isinstance(agent, type) else agent, "__module__", ""), None)
    names = vars(module) if module is not None else {}
    uses = {getattr(v, "__name__", "").split(".")[0] for v in names.values() if inspect.ismodule(v)}
    uses |= {getattr(v, "__module__", "").split(".")[0] for v in names.values() if isinstance(v, type)}
    return "httpx2" if "anthropic" in uses and "openai" not in uses else "httpx"


def _accepted(run: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `extra` that `run` accepts (all of them with a `**kwargs`)."""
    params = inspect.signature(run).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return extra
    return {k: v for k, v in extra.items() if k in params}


async def _load_tokenizer(tokenizer: Any, engine: Any) -> Any:
    """A tokenizer object, a directory to load, or (None) the inference server's own tokenizer."""
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    path = tokenizer
    if path is None:
        path = await _server_tokenizer_path(engine)
    from transformers import AutoTokenizer

    return await asyncio.to_thread(AutoTokenizer.from_pretrained, path)


async def _server_tokenizer_path(engine: Any) -> str:
    errors = []
    for server in list(getattr(engine, "servers", [])):
        try:
            info = await engine.model_info(server)  # /model_info (SGLang 0.5.19+ serves it)
        except Exception as exc:
            errors.append(f"{server}: {exc!r}")
            continue
        path = info.get("tokenizer_path") or info.get("model_path")
        if path:
            return str(path)
        errors.append(f"{server}: no tokenizer_path in its model info")
    raise WorkflowError("the agent workflow needs a tokenizer: set workflow_kwargs.tokenizer (a model directory); "
                        f"asking the inference servers failed: {'; '.join(errors) or 'no servers'}")
