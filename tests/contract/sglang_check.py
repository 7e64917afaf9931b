"""Judge jetrl's HTTP traffic with SGLang's own request and response models (run as a subprocess).

Run with `.cache/sglang/<version>` and `.cache/sglang/deps` on PYTHONPATH (see `sglang_pkg.py`); reads
`{"requests": [{"method", "path", "body"}], "replies": [{"path", "body"}]}` on stdin and prints one
verdict per item: `{"item", "ok", "error"}`. GPU-only imports are kept out by `sglang_stubs.py`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_stubs import install as install_stubs


def judges() -> dict[str, Any]:
    """Path -> a function that raises when SGLang would refuse the body."""
    import sglang.srt.entrypoints.http_server  # noqa: F401 - the app's import is part of the contract
    from pydantic import TypeAdapter
    from sglang.srt.managers import io_struct

    contract = None
    try:
        from sglang.srt.entrypoints.api_contract import generate_contract_error as contract
    except ImportError:  # before the strict request check existed
        pass

    def model(cls: Any) -> Any:
        adapter = TypeAdapter(cls)  # how FastAPI parses a dataclass body
        return lambda body: adapter.validate_python(body)

    def generate(body: Any) -> None:
        if contract is not None and (err := contract(body)) is not None:
            raise ValueError(f"strict request check: {err}")
        obj = TypeAdapter(io_struct.GenerateReqInput).validate_python(body)
        obj.normalize_batch_and_arguments()
        raw = obj.sampling_params or {}
        for one in raw if isinstance(raw, list) else [raw]:  # a batch: one entry per input
            _sampling(one)

    out: dict[str, Any] = {"/generate": generate,
                           "/pause_generation": model(io_struct.PauseGenerationReqInput),
                           "/update_weights_from_disk": model(io_struct.UpdateWeightFromDiskReqInput),
                           "/abort_request": model(io_struct.AbortReq)}
    if hasattr(io_struct, "ContinueGenerationReqInput"):
        out["/continue_generation"] = model(io_struct.ContinueGenerationReqInput)
    out["finish"] = _finish
    out["grammar"] = _grammar
    out["validate"] = _validate
    return out


def _finish(body: dict[str, Any]) -> None:
    """SGLang's own token-based finish rule (`Req._check_token_based_finish`) on one output token:
    raises when SGLang's decision differs from `body["finished"]` (what the CPU server did)."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(**body["sampling_params"])
    req = SimpleNamespace(sampling_params=params, eos_token_ids=set(body["eos"]), tokenizer=None,
                          output_ids=list(body["tokens"]), finished_reason=None, finished_len=None)
    finished = Req._check_token_based_finish(req, list(body["tokens"]))
    if finished != body["finished"]:
        raise ValueError(f"SGLang {'finishes' if finished else 'does not finish'} on {body['tokens']} with {body['sampling_params']}; "
                         f"the CPU server {'did' if body['finished'] else 'did not'}")


def _grammar(body: dict[str, Any]) -> None:
    """SGLang's own grammar admission (`GrammarManager`) on a server started with or without
    `--skip-tokenizer-init`: raises when the CPU server's answer (`body["refused"]`: its 400's text, or
    None when it served the request) differs from SGLang's. The backend's creation is read from
    `GrammarManager.__init__`'s source (building one needs the scheduler); the refusal is SGLang's own
    `process_req_with_grammar` run on a manager without a backend."""
    import inspect
    from types import SimpleNamespace

    from sglang.srt.constrained.grammar_manager import GrammarManager
    from sglang.srt.sampling.sampling_params import SamplingParams

    init = inspect.getsource(GrammarManager.__init__)
    if "skip_tokenizer_init" not in init or "self.grammar_backend = None" not in init:
        raise ValueError("GrammarManager no longer gates its grammar backend on skip_tokenizer_init: re-check jetrl's rule")
    if not body["skip_tokenizer_init"]:  # SGLang builds its backend (xgrammar) and serves the request
        if body["refused"] is not None:
            raise ValueError(f"SGLang with its tokenizer has a grammar backend; the CPU server refused: {body['refused']}")
        return
    aborted: list[str] = []
    req = SimpleNamespace(sampling_params=SamplingParams(**body["sampling_params"]), grammar=None,
                          set_finish_with_abort=lambda msg, *a, **k: aborted.append(msg))
    manager = SimpleNamespace(grammar_backend=None, _enable_strict_thinking=False, grammar_queue=[])
    GrammarManager.process_req_with_grammar(manager, req)  # type: ignore[arg-type]
    if not aborted:
        raise ValueError("SGLang without a grammar backend did not abort the constrained request")
    if body["refused"] is None or aborted[0] not in body["refused"]:
        raise ValueError(f"SGLang aborts with {aborted[0]!r}; the CPU server answered {body['refused']!r}")


def _validate(body: dict[str, Any]) -> None:
    """SGLang's own input validation (`TokenizerManager._validate_one_request`, no auto-truncation) on
    one request, for the model at `model_path` served with `context_len` tokens: raises when SGLang's verdict differs from the CPU
    server's (`body["refused"]`: its 400's text, or None). `body["stricter"]` marks a request the CPU
    server refuses on purpose where SGLang does not (out-of-vocabulary input ids): then SGLang must
    still admit it, so that the day it checks them too this judge says so."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=body["model_path"], skip_tokenizer_init=True, device="cpu")
    try:  # 0.5.14 on: the process-wide server args the checks read
        from sglang.srt.runtime_context import publish
    except ImportError:
        pass
    else:
        publish(args, role="tokenizer")
    tm = TokenizerManager.__new__(TokenizerManager)  # only the attributes the check reads, as __init__ sets them
    tm.__dict__.update(context_len=body["context_len"], allow_auto_truncate=False, validate_total_tokens=True,
                       num_reserved_tokens=0, is_generation=True, model_config=ModelConfig.from_server_args(args))
    obj = GenerateReqInput(input_ids=body["input_ids"], sampling_params=body["sampling_params"])
    obj.normalize_batch_and_arguments()
    try:
        tm._validate_one_request(obj, list(body["input_ids"]))
        sglang = None
    except ValueError as exc:
        sglang = str(exc)
    if body.get("stricter"):
        if sglang is not None:
            raise ValueError(f"SGLang now refuses what only the CPU server refused: {sglang}")
        return
    if (sglang is None) != (body["refused"] is None) or (sglang is not None and sglang not in body["refused"]):
        raise ValueError(f"SGLang: {sglang!r}; the CPU server: {body['refused']!r}")


def _sampling(raw: dict[str, Any]) -> None:
    """SGLang's own sampling checks, as a `--skip-tokenizer-init` server (no tokenizer) runs them."""
    from sglang.srt.sampling import sampling_params as sp_mod

    params = sp_mod.SamplingParams(**raw)
    params.normalize(None)
    params.verify(1 << 20) if params.verify.__code__.co_argcount > 1 else params.verify()
    check = getattr(sp_mod, "raise_if_tokenizer_required", None)
    if check is not None:
        check(None, params.stop_strs, getattr(params, "stop_regex_strs", None), params.min_new_tokens)
    elif params.stop_strs:
        raise ValueError("stop strings are ignored by a server without a tokenizer")


def reply_judges() -> dict[str, Any]:
    import msgspec

    out: dict[str, Any] = {}
    try:
        from sglang.srt.managers.load_snapshot import LoadSnapshot

        def loads(body: Any) -> None:
            for entry in body["loads"]:
                msgspec.convert(entry, LoadSnapshot, strict=True)

        out["/v1/loads"] = loads
    except ImportError:
        pass
    from sglang.srt.entrypoints.openai.protocol import ModelList

    out["/v1/models"] = lambda body: ModelList.model_validate(body)
    return out


def main() -> None:
    install_stubs()
    todo = json.load(sys.stdin)
    req_judges, rep_judges = judges(), reply_judges()
    from sglang.version import __version__

    verdicts = []
    for kind, items, table in (("request", todo.get("requests", []), req_judges), ("reply", todo.get("replies", []), rep_judges)):
        for item in items:
            judge = table.get(item["path"])
            verdict = {"item": f"{kind} {item['path']}", "ok": judge is not None, "error": None if judge else "no judge"}
            if judge is not None:
                try:
                    judge(item["body"])
                except Exception as exc:
                    verdict.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            verdicts.append(verdict)
    print(json.dumps({"version": __version__, "verdicts": verdicts}))


if __name__ == "__main__":
    main()
