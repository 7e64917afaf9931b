"""`jetrl inference`: the SGLang HTTP protocol over the CPU scheduler (see docs/inference.md).

The HTTP side listens at once and answers `/health` 503 until the model is loaded; the decode loop is
a supervised task, so SIGTERM drains in-flight requests and exits within `shutdown_timeout_s`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web

from services.common.logging import get_logger
from services.common.runner import Supervisor, supervise
from services.inference.auth import middleware
from services.inference.dist_weights import DistWeights
from services.inference.grammar import GrammarError, check_grammars
from services.inference.replies import error_body, models_body, output_body
from services.inference.requests import RequestError, parse_generate
from services.inference.scheduler import Scheduler, Seq
from services.inference.settings import InferenceSettings
from services.inference.tensor_update import TensorUpdate
from services.inference.weights import WeightLoadError

log = get_logger("inference")

FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)
"""SGLang's answer to `update_weights_from_disk` with the default `flush_cache` while requests are held."""


def _refuse_tokenizer_features(stop: tuple[str, ...], min_new_tokens: int) -> None:
    """SGLang's check with `--skip-tokenizer-init`: what needs a tokenizer is a 400, not ignored."""
    if stop:
        raise RequestError(f"stop={list(stop)!r} is unavailable when skip_tokenizer_init=True "
                           "(requires tokenizer to decode tokens to text for matching).")
    if min_new_tokens > 0:
        raise RequestError(f"min_new_tokens={min_new_tokens} is unavailable when skip_tokenizer_init=True "
                           "(requires tokenizer for eos_token_id).")


def make_backend(settings: InferenceSettings) -> Any:
    if settings.simulate:
        from services.inference.simulate import SimulatedBackend

        return SimulatedBackend(settings.sim, seed=settings.seed, version=settings.weight_version)
    from services.inference.model_backend import TransformersBackend

    return TransformersBackend(
        settings.model_path, seed=settings.seed, version=settings.weight_version, threads=settings.torch_threads,
        tokenizer=not settings.skip_tokenizer_init, device=settings.device, dtype=settings.dtype,
        attn_implementation=settings.attn_implementation or None, memory_fraction=settings.memory_fraction,
    )


class InferenceServer:
    def __init__(self, settings: InferenceSettings) -> None:
        self.settings = settings
        self.scheduler: Scheduler | None = None
        self.stopping = False
        self.generate_calls = 0
        """`/generate` HTTP requests received (a batch is one), in `/server_info`."""
        self.dist_weights = DistWeights(lambda: self.sched, settings.weights_group_timeout_s)
        self.tensor_update = TensorUpdate(lambda: self.sched)

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and not self.stopping

    def start(self, backend: Any) -> Scheduler:
        self.scheduler = Scheduler(backend, self.settings.max_batch_size)
        return self.scheduler

    @property
    def context_length(self) -> int:
        assert self.scheduler is not None
        return self.settings.context_length or self.scheduler.backend.context_length

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[middleware(*self.settings.keys()), self._not_ready])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.resume)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/abort_request", self.abort_request)
        r.add_get("/flush_cache", self.flush_cache)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/ready", self.health)  # SGLang's readiness route: answers at once, also while paused
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)  # deprecated in SGLang, still served
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/loads", self.load)
        self.dist_weights.register(r)  # SGLang's distributed weight update (dist_weights.py)
        self.tensor_update.register(r)  # SGLang's update from tensors by handle, same host (tensor_update.py)
        return app

    @web.middleware
    async def _not_ready(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not self.ready and request.path not in ("/health", "/health_generate", "/ready"):
            return web.json_response(error_body("server is starting or shutting down"), status=503)
        return await handler(request)

    @property
    def sched(self) -> Scheduler:
        assert self.scheduler is not None
        return self.scheduler

    async def _json(self, request: web.Request) -> Any:
        if not request.can_read_body:
            return {}
        try:
            return await request.json()
        except json.JSONDecodeError as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from exc

    # ---- generation ----------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.generate_calls += 1
        backend = self.sched.backend
        try:
            gen = parse_generate(
                await self._json(request),
                vocab_size=backend.vocab_size,
                context_length=self.context_length,
                tokenize=backend.tokenize if backend.tokenizer is not None and not self.settings.skip_tokenizer_init else None,
            )
            if self.settings.skip_tokenizer_init:
                for params in gen.param_list:
                    _refuse_tokenizer_features(params.stop, params.min_new_tokens)
            if gen.stream and len(gen.prompts) > 1:
                raise RequestError("stream: true with a batch input or n > 1 is not supported by the CPU server")
            if any(p.grammar is not None for p in gen.param_list):  # compiled now: a bad grammar is this 400
                skip = self.settings.skip_tokenizer_init
                check_grammars([p.grammar for p in gen.param_list], None if skip else getattr(backend, "grammars", None))
        except (RequestError, GrammarError) as exc:
            return web.json_response(error_body(str(exc)), status=400)
        rids: list[str | None] = [*gen.rids] if gen.rids else [None] * len(gen.prompts)
        seqs = [await self.sched.submit(p, params, rid) for p, params, rid in zip(gen.prompts, gen.param_list, rids, strict=True)]
        try:
            if gen.stream:
                return await self._stream(request, seqs[0], gen.return_logprob)
            for s in seqs:  # one after another: no task per sample, and the same wait for the last
                await s.done.wait()
        finally:
            # A client that went away (the handler is cancelled) aborts what it asked for. Marked, not
            # awaited: a cancelled handler cannot wait, and a fire-and-forget task could be collected.
            for s in seqs:
                if s.finish is None:
                    self.sched.abort_soon(s.rid)
        outs = [self._out(s, flag) for s, flag in zip(seqs, gen.return_logprobs, strict=True)]
        # orjson: the reply's encoding is a per-sample cost of every generation (several times the stdlib's)
        return web.Response(body=orjson.dumps(outs if gen.batched else outs[0]), content_type="application/json")

    def _out(self, seq: Seq, return_logprob: bool) -> dict[str, Any]:
        skip = self.settings.skip_tokenizer_init
        body = output_body(seq, self.sched.backend, return_logprob=return_logprob, server_version=self.sched.backend.version, text=not skip)
        if skip:
            body.pop("text", None)  # the empty text of an abort before prefill too
        return body

    async def _stream(self, request: web.Request, seq: Seq, return_logprob: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = -1
        while True:
            await seq.progress.wait()
            seq.progress.clear()
            if len(seq.output_ids) != sent or seq.finish is not None:
                sent = len(seq.output_ids)
                chunk = self._out(seq, return_logprob)
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            if seq.finish is not None:
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- control -------------------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        mode = (body or {}).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return web.json_response(error_body(f"pause mode {mode!r}: expected abort, retract or in_place"), status=400)
        await self.sched.pause(mode)
        log.info("generation paused", mode=mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        self.sched.resume()
        log.info("generation continued")
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        path = body.get("model_path") if isinstance(body, dict) else None
        if not path:
            return web.json_response({"success": False, "message": "model_path is required"}, status=400)
        version = body.get("weight_version")
        if body.get("abort_all_requests"):
            await self.sched.abort(None)
        held = len(self.sched.running) + len(self.sched.waiting)
        try:
            msg = await self.sched.in_model_thread(self.sched.backend.load_weights, str(path), None if version is None else str(version))
        except WeightLoadError as exc:
            log.warning("weight update failed; old weights keep serving", error=str(exc))
            return web.json_response({"success": False, "message": str(exc), "num_paused_requests": 0}, status=400)
        log.info("weights updated", model_path=path, version=self.sched.backend.version)
        if body.get("flush_cache", True) and held:
            # SGLang's order: the weights and version have changed, then the cache flush is refused
            # because requests are held (an in_place / retract pause), and the call answers 400.
            return web.json_response({"success": False, "message": FLUSH_REFUSED, "num_paused_requests": 0}, status=400)
        return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if not isinstance(body, dict) or body.get("new_version") is None:
            return web.json_response({"success": False, "message": "new_version is required"}, status=400)
        if body.get("abort_all_requests", True):
            await self.sched.abort(None)
        self.sched.backend.version = str(body["new_version"])
        return web.json_response({"success": True, "message": "ok", "new_version": self.sched.backend.version})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._json(request) or {}
        if body.get("abort_all"):
            await self.sched.abort(None)
        elif body.get("rid"):
            await self.sched.abort(str(body["rid"]))
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.sched.running or self.sched.waiting:
            return web.Response(status=400, text="Cache not flushed: requests are running.\n")
        return web.Response(text="Cache flushed.\n")

    # ---- info ----------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.ready and request.path != "/ready" and self.sched.paused:
            # SGLang's /health runs a one-token generation: it waits out a pause, then gives up with 503
            try:
                await asyncio.wait_for(self.sched.wait_resumed(), self.settings.health_check_timeout_s)
            except TimeoutError:
                return web.Response(status=503, text="paused")
        return web.Response(status=200 if self.ready else 503, text="ok" if self.ready else "starting")

    async def model_info(self, request: web.Request) -> web.Response:
        b = self.sched.backend
        return web.json_response({
            "model_path": b.model_path, "served_model_name": b.model_path,
            "tokenizer_path": b.tokenizer_path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": b.version,
        })

    async def server_info(self, request: web.Request) -> web.Response:
        info = self.settings.model_dump(mode="json")
        info.update(version=self.settings.sglang_version, frontend="jetrl-cpu", context_length=self.context_length,
                    vocab_size=self.sched.backend.vocab_size,
                    weight_version=self.sched.backend.version, tokens_generated=self.sched.tokens_generated,
                    requests_finished=self.sched.requests_finished, generate_calls=self.generate_calls,
                    model_steps=self.sched.model_steps, paused=self.sched.paused,
                    forward_rows=_forward_rows(self.sched.backend), cpu_s=round(time.process_time(), 3))
        return web.json_response(info)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(models_body(self.sched.backend.model_path, self.context_length))

    async def load(self, request: web.Request) -> web.Response:
        """SGLang's `/v1/loads`: one entry per data-parallel rank (here one) with its core counters."""
        running, waiting = len(self.sched.running), len(self.sched.waiting)
        used = sum(len(s.prompt) + len(s.output_ids) for s in self.sched.running.values())
        load = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                "num_used_tokens": used, "num_total_tokens": used, "max_running_requests": self.settings.max_batch_size}
        return web.json_response({"timestamp": datetime.now(UTC).isoformat(), "version": self.settings.sglang_version,
                                  "accelerator": None, "num_accelerators": 0, "loads": [load]})


async def run(settings: InferenceSettings) -> None:
    if settings.engine == "sglang":
        from services.inference.sglang_launch import run_sglang

        await run_sglang(settings)
        return
    server = InferenceServer(settings)

    async def main(sup: Supervisor) -> None:
        runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        sup.stack.push_async_callback(runner.cleanup)
        port = runner.addresses[0][1]
        log.info("listening; loading model", url=f"http://{settings.host}:{port}", simulate=settings.simulate)
        backend = await asyncio.to_thread(make_backend, settings)
        scheduler = server.start(backend)
        sup.spawn("decode-loop", scheduler.run(sup.stopping))
        sup.spawn("unready-on-stop", _mark_stopping(sup, server))
        sup.stack.callback(_log_totals, server)
        log.info("ready", url=f"http://{settings.host}:{port}", model_path=backend.model_path, version=backend.version,
                 device=settings.device, dtype=settings.dtype, startup_cpu_s=round(time.process_time(), 3),
                 cpus=sorted(os.sched_getaffinity(0)))

    await supervise("inference", main, settings.shutdown_timeout_s)


def _log_totals(server: InferenceServer) -> None:
    """At exit: what this server did and the CPU it took (CPU per sample is its cost on a shared machine)."""
    sched = server.sched
    log.info("served", requests_finished=sched.requests_finished, tokens_generated=sched.tokens_generated,
             generate_calls=server.generate_calls, model_steps=sched.model_steps, cpu_s=round(time.process_time(), 3),
             forward_rows=_forward_rows(sched.backend))


def _forward_rows(backend: Any) -> dict[str, dict[str, int]]:
    """Per forward kind, {rows: forwards that ran that many rows} (empty for the simulator)."""
    return {kind: {str(k): n for k, n in sorted(c.items())} for kind, c in getattr(backend, "forward_rows", {}).items()}


async def _mark_stopping(sup: Supervisor, server: InferenceServer) -> None:
    await sup.stopping.wait()
    server.stopping = True
    if server.scheduler is not None:
        server.scheduler.resume()  # requests blocked by a pause must not hold shutdown
