"""`SGLangClient`: the SGLang client rollout workflows call (`agenerate`), plus weight control; the
implementation over aiohttp of the workflows' `InferenceEngine` protocol (`engine_api.py`).

Interruptible generation (AReaL's `agenerate`): a pass that ends in `abort` (a weight update paused the
server) is continued with prompt + tokens so far and the remaining budget, so one completion can carry
tokens of several weight versions. Transport failures (timeouts, connection errors, 408/429/5xx) are
retried with capped jittered backoff, then the next server takes over; a 400 is the caller's bug and
raises at once. Payloads and replies are handled by the pure functions in `sglang_protocol.py`. Passes that
start together are sent as one batched `/generate` (`batching.py`).

Stop strings are applied here, not by the server: SGLang started with `--skip-tokenizer-init` (as jetrl
starts it) refuses `stop` with a 400, and older versions silently ignored it. Each server's SGLang version
is read once, at its first use, and a server too old for jetrl fails then with a message naming both.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from schemas.sglang_protocol import (
    MODEL_INFO,
    ProtocolError,
    build_generate_payload,
    check_server_version,
    cut_at_stop,
    error_message,
    parse_generate_reply,
    parse_server_version,
    parse_version,
)
from services.common.busretry import retry
from services.common.logging import get_logger
from services.common.trust import bearer_for
from services.rollout.batching import GenerateBatcher
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.io_struct import (
    BadRequestError,
    InferenceError,
    ModelRequest,
    ModelResponse,
    ServersUnavailableError,
    WeightUpdateMeta,
)
from services.rollout.replies import json_or_text

log = get_logger("inference-client")


class SGLangClient:
    """jetrl's `InferenceEngine` (engine_api.py): generation on a set of SGLang-protocol servers, and their weight control."""

    def __init__(self, settings: InferenceClientSettings, keys: tuple[str, str] = ("", "")) -> None:
        """keys: the servers' (api_key, admin_api_key), each shown where a server wants it
        (`Authorization: Bearer`; a service's `trust.inference_api_key` / `inference_admin_api_key`)."""
        if not settings.servers:
            raise ValueError("InferenceClientSettings.servers is empty: give at least one server URL")
        self.settings = settings
        self.keys = keys
        self.servers = [s.rstrip("/") for s in settings.servers]
        self._inflight: dict[str, int] = {s: 0 for s in self.servers}
        self._down_until: dict[str, float] = {}
        self._rr = itertools.count()
        self._episodes: dict[str, str] = {}
        self._versions: dict[str, tuple[int, ...] | None] = {}  # each server's SGLang version, read once
        self._connecting: dict[str, asyncio.Future[tuple[int, ...] | None]] = {}
        self._decode: Callable[[list[int]], str] | None = None
        # aiohttp rather than httpx: httpx's pool slows down sharply with many requests in flight
        # (measured: 64 concurrent generations ran slower than 16). Created on first use, in the loop.
        self._session: aiohttp.ClientSession | None = None
        self.batcher = GenerateBatcher(self._post_generate, settings.batch_max_size)
        self.constrained_restarts = 0  # constrained generations an abort cut, restarted from their prompt

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, sock_connect=self.settings.connect_timeout_s)

    # ---- server choice -------------------------------------------------------------------------
    def _up(self) -> list[str]:
        now = time.monotonic()
        up = [s for s in self.servers if self._down_until.get(s, 0.0) <= now]
        return up or list(self.servers)  # all down: try them all again rather than give up

    def _choose(self, episode: str | None) -> str:
        up = self._up()
        if episode is not None and self._episodes.get(episode) in up:
            return self._episodes[episode]
        if self.settings.policy == "round_robin":
            server = up[next(self._rr) % len(up)]
        else:
            low = min(self._inflight[s] for s in up)
            server = next(s for s in up if self._inflight[s] == low)
        if episode is not None:
            self._episodes[episode] = server
        return server

    def _order(self, first: str) -> list[str]:
        """`first`, then the other servers (healthy ones first, least loaded first)."""
        up = set(self._up())
        rest = [s for s in self.servers if s != first]
        rest.sort(key=lambda s: (s not in up, self._inflight[s]))
        return [first, *rest]

    def release_episode(self, episode: str) -> None:
        """Forget an episode's server (call when the episode ends to keep the map small)."""
        self._episodes.pop(episode, None)

    # ---- HTTP with retry and failover ----------------------------------------------------------
    async def _post_once(self, server: str, path: str, payload: dict[str, Any], timeout_s: float | None) -> Any:
        """One POST with retries on this server (`busretry.retry`: `max_retries`, full-jittered backoff).
        Raises BadRequestError on 4xx, `_Unavailable` when the retries are spent."""

        async def attempt() -> Any:
            try:
                timeout = self._timeout(timeout_s if timeout_s is not None else self.settings.request_timeout_s)
                async with self._http().post(server + path, json=payload, timeout=timeout, headers=bearer_for(path, *self.keys)) as resp:
                    status, text = resp.status, await resp.text()
            except TimeoutError:
                raise _Unavailable("timeout") from None
            except aiohttp.ClientError as exc:
                raise _Unavailable(f"connection error ({type(exc).__name__}: {exc})") from exc
            if status in (408, 429) or status >= 500:
                raise _Unavailable(f"HTTP {status}: {text[:200]}")
            body = json_or_text(text)
            if status >= 400:
                raise BadRequestError(f"{server}{path}: HTTP {status}: {error_message(body, text[:500])}")
            return body

        try:
            return await retry(attempt, when=lambda exc: isinstance(exc, _Unavailable), attempts=self.settings.max_retries + 1,
                               initial_s=self.settings.backoff_initial_s, max_s=self.settings.backoff_max_s)
        except _Unavailable as exc:
            raise _Unavailable(f"{server}{path}: {exc}") from None

    async def _post(
        self, server: str, path: str, payload: dict[str, Any], episode: str | None, samples: int = 1
    ) -> tuple[Any, str]:
        """POST with retries, then failover to the next server; `samples`: how many requests the body
        carries (a batch counts each of its passes toward the server's load)."""
        errors = []
        for candidate in self._order(server):
            self._inflight[candidate] += samples
            try:
                return await self._post_once(candidate, path, payload, None), candidate
            except _Unavailable as exc:
                errors.append(str(exc))
                self._down_until[candidate] = time.monotonic() + self.settings.down_cooldown_s
                log.warning("inference server unavailable; failing over", server=candidate, error=str(exc))
                if episode is not None:
                    self._episodes.pop(episode, None)
            finally:
                self._inflight[candidate] -= samples
        raise ServersUnavailableError("every inference server failed: " + "; ".join(errors))

    # ---- generation ----------------------------------------------------------------------------
    async def _connected(self, server: str, episode: str | None) -> str:
        """`server` once its version is read, or the next server that answers when it does not."""
        errors = []
        for candidate in self._order(server):
            try:
                await self.connect(candidate)
            except ServersUnavailableError as exc:
                errors.append(str(exc))
                self._down_until[candidate] = time.monotonic() + self.settings.down_cooldown_s
                log.warning("inference server unavailable; failing over", server=candidate, error=str(exc))
                continue
            if episode is not None and candidate != server:
                self._episodes[episode] = candidate
            return candidate
        raise ServersUnavailableError("every inference server failed: " + "; ".join(errors))

    async def _post_generate(self, server: str, payload: dict[str, Any], episode: str | None, samples: int) -> tuple[Any, str]:
        return await self._post(server, "/generate", payload, episode, samples)

    async def _generate_pass(self, server: str, payload: dict[str, Any], episode: str | None) -> tuple[Any, str]:
        if self.settings.batch_generate:
            return await self.batcher.generate(server, payload, episode)
        return await self._post(server, "/generate", payload, episode)

    async def agenerate(self, req: ModelRequest, *, episode: str | None = None) -> ModelResponse:
        """Generate until `stop`/`length`, continuing across aborts; tokens carry their versions."""
        if req.max_new_tokens < 0:
            raise BadRequestError(f"max_new_tokens must be >= 0, got {req.max_new_tokens}")
        if req.top_logprobs < 0:
            raise BadRequestError(f"top_logprobs must be >= 0, got {req.top_logprobs}")
        start = time.monotonic()
        server = await self._connected(self._choose(episode), episode)
        decode = await self._decoder() if req.stop else None
        matched: str | None = None
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        tops: list[list[tuple[int, float]]] = []
        passes = 0
        idle_aborts = 0
        while True:
            passes += 1
            if passes > self.settings.max_passes:
                raise InferenceError(f"gave up after {self.settings.max_passes} aborted passes (server {server})")
            payload = build_generate_payload(
                req.input_ids + ids,
                max_new_tokens=req.max_new_tokens - len(ids),
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                seed=req.seed,
                rid=f"{req.rid}-p{passes}" if req.rid else None,
                top_logprobs_num=req.top_logprobs,
                **req.extras(),
            )
            body, server = await self._generate_pass(server, payload, episode)
            if episode is not None:
                self._episodes[episode] = server
            try:
                part = parse_generate_reply(body)
            except ProtocolError as exc:
                raise InferenceError(f"{server}: {exc}") from exc
            if req.top_logprobs > 0 and part.output_ids and not part.output_top_logprobs:
                raise InferenceError(f"{server}: asked for top_logprobs_num={req.top_logprobs}, got no output_top_logprobs")
            ids += part.output_ids
            logprobs += part.output_logprobs
            versions += part.output_versions
            tops += part.output_top_logprobs
            cut = cut_at_stop(ids, req.stop, decode) if decode is not None else None
            if cut is not None:
                keep, matched = cut
                del ids[keep:], logprobs[keep:], versions[keep:], tops[keep:]
                stop_reason = "stop"
                break
            if part.finished:
                stop_reason = part.finish_type
                break
            if part.finish_type != "abort":
                raise InferenceError(f"{server}: unknown finish_reason {part.finish_type!r}")
            if part.status_code == 400:
                raise BadRequestError(f"{server}: request aborted: {part.finish_message}")
            if len(ids) >= req.max_new_tokens:
                stop_reason = "length"
                break
            if req.constrained and ids:  # a grammar's state cannot pass to a continuation: start over
                self.constrained_restarts += 1
                log.info("constrained generation aborted; restarted", dropped=len(ids), restarts=self.constrained_restarts)
                ids, logprobs, versions, tops = [], [], [], []
            # An abort with no progress (e.g. "Abort before prefill"): a paused server blocks the next
            # pass itself, so only a short growing pause guards against a server that aborts at once.
            idle_aborts = 0 if part.output_ids else idle_aborts + 1
            if idle_aborts > 1:
                await asyncio.sleep(min(1.0, 0.01 * 2**idle_aborts))
        return ModelResponse(
            input_ids=list(req.input_ids),
            output_ids=ids,
            output_logprobs=logprobs,
            output_versions=versions,
            output_top_logprobs=tops,
            stop_reason=stop_reason,
            latency_s=time.monotonic() - start,
            server=server,
            passes=passes,
            stop_matched=matched,
        )

    # ---- control -------------------------------------------------------------------------------
    def _targets(self, server: str | None) -> list[str]:
        return [server.rstrip("/")] if server else list(self.servers)

    async def _control(self, server: str | None, path: str, payload: dict[str, Any]) -> list[Any]:
        async def one(s: str) -> Any:
            try:
                return await self._post_once(s, path, payload, self.settings.control_timeout_s)
            except _Unavailable as exc:
                raise ServersUnavailableError(str(exc)) from exc

        return list(await asyncio.gather(*(one(s) for s in self._targets(server))))

    async def pause(self, server: str | None = None) -> None:
        """Pause generation in abort mode: in-flight requests return their partial tokens."""
        await self._control(server, "/pause_generation", {"mode": "abort"})

    async def resume(self, server: str | None = None) -> None:
        await self._control(server, "/continue_generation", {})

    async def update_weights(self, meta: WeightUpdateMeta, server: str | None = None) -> None:
        """Load new weights on `server` (default: every server) without losing a generation: pause in
        abort mode (in-flight requests return their tokens so far and `agenerate` continues them),
        load from disk, resume - resumed even when the load fails (the old weights keep serving)."""
        if meta.type != "disk":
            raise NotImplementedError(f"weight update transport {meta.type!r}: only 'disk' is built")
        await self.pause(server)
        try:
            await self.update_weights_from_disk(meta.path, meta.version, server)
        finally:
            await self.resume(server)

    async def update_weights_from_disk(self, model_path: str, version: int, server: str | None = None) -> None:
        """Load a HF checkpoint directory; raises BadRequestError with the server's message on failure."""
        bodies = await self._control(
            server, "/update_weights_from_disk", {"model_path": str(model_path), "weight_version": str(version)}
        )
        for s, body in zip(self._targets(server), bodies, strict=True):
            if isinstance(body, dict) and body.get("success") is False:
                raise BadRequestError(f"{s}: update_weights_from_disk failed: {body.get('message')}")

    async def _get(self, url: str) -> tuple[int, Any, str]:
        try:
            headers = bearer_for(urlsplit(url).path, *self.keys)
            async with self._http().get(url, timeout=self._timeout(self.settings.control_timeout_s), headers=headers) as resp:
                status, text = resp.status, await resp.text()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise ServersUnavailableError(f"{url}: {exc!r}") from exc
        return status, json_or_text(text), text

    async def connect(self, server: str) -> tuple[int, ...] | None:
        """Read `server`'s SGLang version (once) and refuse a server too old for jetrl (InferenceError
        naming the version and the missing feature). None: the server reports no version (a router)."""
        server = server.rstrip("/")
        if server in self._versions:
            return self._versions[server]
        # One read per server however many requests start at once: they all wait on it and so go on
        # in the same event-loop turn, where their passes are batched together.
        reading = self._connecting.get(server)
        if reading is None:
            reading = self._connecting[server] = asyncio.ensure_future(self._read_version(server))
            reading.add_done_callback(lambda _: self._connecting.pop(server, None))
        return await asyncio.shield(reading)

    async def _read_version(self, server: str) -> tuple[int, ...] | None:
        version = None
        busy = False
        for path in ("/server_info", "/get_server_info"):  # /server_info is the newer name
            status, body, _ = await self._get(server + path)
            if status == 200 and isinstance(body, dict):
                version = parse_server_version(body.get("version"))
                break
            busy = busy or status >= 500
        try:
            check_server_version(server, version)
        except ProtocolError as exc:
            raise InferenceError(str(exc)) from exc
        # "No version" is remembered only from a server that answered without one (a router); one
        # still loading (503) is asked again next time, or its version would never be checked.
        if version is not None or not busy:
            self._versions[server] = version
        return version

    async def model_info(self, server: str) -> dict[str, Any]:
        """The server's model info (`/model_info`), once its version is checked."""
        await self.connect(server)
        url = server.rstrip("/") + MODEL_INFO
        status, body, text = await self._get(url)
        if status != 200 or not isinstance(body, dict):
            raise InferenceError(f"{url}: HTTP {status}: {text[:200]}")
        return body

    async def get_weight_version(self, server: str) -> int:
        return parse_version((await self.model_info(server)).get("weight_version"))

    async def _decoder(self) -> Callable[[list[int]], str]:
        """The tokenizer's decode, for stop strings (loaded once, off the event loop)."""
        if self._decode is None:
            path = self.settings.tokenizer_path
            if not path:
                path = str((await self.model_info(self.servers[0])).get("tokenizer_path") or "")
            if not path:
                raise BadRequestError("stop strings need a tokenizer: set tokenizer_path (the server reports none)")
            from transformers import AutoTokenizer

            tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)
            self._decode = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False))
            log.info("stop strings applied client-side", tokenizer=path)
        return self._decode

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class _Unavailable(Exception):
    """One server's retries are spent (internal: turns into failover)."""
