"""SGLang's own HTTP app (`sglang.srt.entrypoints.http_server.app`) on CPU, for the contract tier.

Run as `python sglang_app.py PORT UPSTREAM MODEL_PATH` with `.cache/sglang/<version>` and
`.cache/sglang/deps` on PYTHONPATH. SGLang's routes, request parsing and validation (the strict
`/generate` check, its sampling-parameter checks as a `--skip-tokenizer-init` server runs them) and
response wrappers are SGLang's; only the `TokenizerManager` the routes call is replaced by `StandIn`,
which hands the admitted requests to jetrl's CPU server at UPSTREAM (where SGLang's GPU scheduler would
be). The SGLang internals this relies on are listed in docs/sglang.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_stubs import install as install_stubs


def sends_weight_version_spans() -> bool:
    """Whether this SGLang's TokenizerManager adds per-token `weight_versions` spans to `meta_info`
    (0.5.19 on); older ones send only the pass's `weight_version`, so the stand-in drops the spans."""
    import importlib.util

    try:
        return importlib.util.find_spec("sglang.srt.utils.weight_versions") is not None
    except ImportError:  # sglang.srt.utils was a module, not a package
        return False


def _has_weight_update_sessions() -> bool:
    """Whether this SGLang wants weight updates inside `/begin_weight_update` ... `/end_weight_update` (0.5.21 on)."""
    from sglang.srt.managers import io_struct

    return hasattr(io_struct, "BeginWeightUpdateReqInput")


class StandIn:
    """The part of SGLang's `TokenizerManager` the routes jetrl calls use, backed by the CPU server."""

    def __init__(self, upstream: str, server_args: Any, model_config: Any, vocab_size: int) -> None:
        import httpx
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.http = httpx.AsyncClient(base_url=upstream, timeout=600)
        self.server_args = server_args
        self.model_config = model_config
        self.vocab_size = vocab_size
        self.model_path = server_args.model_path
        self.served_model_name = server_args.served_model_name or server_args.model_path
        self.is_generation = True
        self.is_image_gen = False  # read by /health before 0.5.8
        self.tokenizer = None  # --skip-tokenizer-init
        self.startup_time = time.time()
        self.last_receive_tstamp = time.time()
        self.rid_to_state: dict[str, Any] = {}
        self.server_status = ServerStatus.Up
        self.gracefully_exit = False
        self.weight_version = server_args.weight_version
        self.spans = sends_weight_version_spans()
        self.sessions = _has_weight_update_sessions()
        self.in_session = False

    def _set_version(self, version: str) -> None:
        # Routes read `config_value("weight_version")` from 0.5.19 (server args are read-only there),
        # `server_args.weight_version` before.
        self.weight_version = version
        with contextlib.suppress(AttributeError):
            self.server_args.weight_version = version

    def is_ready(self) -> bool:
        return True

    def config_value(self, name: str) -> Any:
        return self.weight_version if name == "weight_version" else getattr(self.server_args, name, None)

    async def generate_request(self, obj: Any, request: Any = None) -> Any:
        from sglang.srt.sampling.sampling_params import SamplingParams

        # What TokenizerManager does before tokenizing: normalize, then SGLang's sampling checks (per
        # input of a batch). A batch goes upstream as one batch, where SGLang's scheduler would get its
        # inputs together; like TokenizerManager's batch path, it answers a list or fails as a whole.
        obj.normalize_batch_and_arguments()
        raws = [dict(r or {}) for r in obj.sampling_params] if not obj.is_single else [dict(obj.sampling_params or {})]
        for raw in raws:
            params = SamplingParams(**raw)
            params.normalize(self.tokenizer)
            params.verify(self.vocab_size)
        body = {"input_ids": obj.input_ids, "sampling_params": raws if not obj.is_single else raws[0],
                "return_logprob": obj.return_logprob, "logprob_start_len": obj.logprob_start_len, "rid": obj.rid,
                "stream": False}
        if not obj.is_single:
            body["top_logprobs_num"] = obj.top_logprobs_num
        resp = await self.http.post("/generate", json=body)
        self.last_receive_tstamp = time.time()
        out = resp.json()
        if resp.status_code != 200:
            raise ValueError(out.get("error", {}).get("message", resp.text))
        for one in out if isinstance(out, list) else [out]:
            self._set_version(one["meta_info"].get("weight_version", self.weight_version))
            if not self.spans:
                one["meta_info"].pop("weight_versions", None)
        yield out

    def create_abort_task(self, obj: Any) -> None:
        return None

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        asyncio.get_running_loop().create_task(self.http.post("/abort_request", json={"rid": rid, "abort_all": abort_all}))

    async def pause_generation(self, obj: Any = None) -> None:  # no argument before 0.5.6: always abort
        await self.http.post("/pause_generation", json={"mode": getattr(obj, "mode", "abort")})

    async def continue_generation(self, obj: Any = None) -> None:
        await self.http.post("/continue_generation", json={})

    async def update_weights_from_disk(self, obj: Any, request: Any = None) -> tuple[bool, str, int]:
        body = {"model_path": obj.model_path, "weight_version": obj.weight_version,
                "flush_cache": getattr(obj, "flush_cache", True), "abort_all_requests": obj.abort_all_requests}
        out = (await self.http.post("/update_weights_from_disk", json=body)).json()
        info = (await self.http.get("/model_info")).json()  # the version changes even when the flush is refused
        self._set_version(info["weight_version"])
        self.model_path = info["model_path"]
        return bool(out["success"]), str(out["message"]), int(out.get("num_paused_requests", 0))

    async def update_weights_from_tensor(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        """SGLang parsed and validated the request (its payloads: base64 text, decoded to bytes by the
        versions whose field is `Base64Bytes`); they go on to the CPU server as base64. From 0.5.21 the
        scheduler refuses an update outside a `/begin_weight_update` session; so does this stand-in."""
        import base64

        if self.sessions and not self.in_session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        entries = [e if isinstance(e, str) else base64.b64encode(bytes(e)).decode() for e in obj.serialized_named_tensors]
        body = {"serialized_named_tensors": entries, "load_format": obj.load_format, "flush_cache": obj.flush_cache,
                "abort_all_requests": obj.abort_all_requests, "weight_version": obj.weight_version}
        out = (await self.http.post("/update_weights_from_tensor", json=body)).json()
        if out["success"] and obj.weight_version is not None:
            self._set_version(str(obj.weight_version))
        return bool(out["success"]), str(out["message"])

    async def begin_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        self.in_session = True
        return True, "Success"

    async def end_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        self.in_session = False
        return True, "Success"

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [{}]

    async def get_loads(self, include: Any = None, dp_rank: Any = None) -> list[Any]:
        from sglang.srt.managers.load_snapshot import LoadSnapshot

        body = (await self.http.get("/v1/loads")).json()
        fields = set(LoadSnapshot.__struct_fields__)
        return [LoadSnapshot(**{k: v for k, v in load.items() if k in fields}) for load in body["loads"]]


def main() -> None:
    port, upstream, model_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    install_stubs()
    import httpx
    import uvicorn
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.server_args import ServerArgs

    version = httpx.get(upstream + "/model_info", timeout=60).json()["weight_version"]  # the CPU server's, now
    args = ServerArgs(model_path=model_path, skip_tokenizer_init=True, device="cpu", weight_version=version,
                      host="127.0.0.1", port=port)
    try:  # 0.5.14 on: the process-wide server args the tokenizer side reads
        from sglang.srt.runtime_context import publish
    except ImportError:
        pass
    else:
        publish(args, role="tokenizer")
    model_config = ModelConfig.from_server_args(args)
    tm = StandIn(upstream, args, model_config, model_config.vocab_size)
    hs.set_global_state(hs._GlobalState(tokenizer_manager=tm, template_manager=None, scheduler_info={}))
    uvicorn.run(hs.app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    main()
