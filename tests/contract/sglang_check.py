"""Judge jetrl's HTTP traffic with SGLang's own request and response models (run as a subprocess).

Run with `.cache/sglang/<version>` and `.cache/sglang/deps` on PYTHONPATH (see `sglang_pkg.py`); reads
`{"requests": [{"method", "path", "body"}], "replies": [{"path", "body"}]}` on stdin and prints one
verdict per item: `{"item", "ok", "error"}`. GPU-only imports are kept out by stubs: triton through
SGLang's own stub (the one it installs on macOS), torchvision and soundfile as inert modules offered
only to imports made from SGLang's files, so transformers still sees them as absent.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import platform
import sys
import types
from typing import Any

STUBBED = ("torchvision", "soundfile")


def _sglang_dir() -> str:
    for entry in sys.path:
        if os.path.isfile(os.path.join(entry, "sglang", "version.py")):
            return entry
    raise SystemExit("sglang is not on PYTHONPATH")


SG = _sglang_dir()


def _platform_stubs() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("_sglang_platform_stubs", os.path.join(SG, "sglang", "_platform_stubs.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def install_stubs() -> None:
    ps = _platform_stubs()
    import torch

    # SGLang installs its triton stub only on Apple silicon: present that platform for the one call.
    saved = (sys.platform, platform.machine, torch.backends.mps.is_available, ps._patch_non_blocking)
    sys.platform, platform.machine = "darwin", lambda: "arm64"  # type: ignore[misc]
    torch.backends.mps.is_available = lambda: True  # type: ignore[assignment]
    ps._patch_non_blocking = lambda: None
    try:
        ps.install_platform_stubs()
    finally:
        sys.platform, platform.machine, torch.backends.mps.is_available, ps._patch_non_blocking = saved  # type: ignore[misc]

    class Loader:
        def create_module(self, spec: Any) -> Any:
            return ps._MockModule(spec.name)

        def exec_module(self, module: Any) -> None:
            pass

    class Finder:
        def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
            if fullname.split(".")[0] not in STUBBED or not _imported_from_sglang():
                return None
            return importlib.machinery.ModuleSpec(fullname, Loader(), is_package=True)

    sys.meta_path.insert(0, Finder())


def _imported_from_sglang() -> bool:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(os.path.join(SG, "sglang"))


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
        _sampling(obj.sampling_params or {})

    out: dict[str, Any] = {"/generate": generate,
                           "/pause_generation": model(io_struct.PauseGenerationReqInput),
                           "/update_weights_from_disk": model(io_struct.UpdateWeightFromDiskReqInput),
                           "/abort_request": model(io_struct.AbortReq)}
    if hasattr(io_struct, "ContinueGenerationReqInput"):
        out["/continue_generation"] = model(io_struct.ContinueGenerationReqInput)
    return out


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
