"""SGLang from PyPI for the contract tier, without torch or CUDA packages.

`install(version)` puts the `sglang` wheel, unpacked with `pip install --no-deps`, into
`.cache/sglang/<version>/`, and `install_deps()` the light pure-python packages its HTTP app imports
into `.cache/sglang/deps/` (also `--no-deps`, pinned: nothing can pull torch or CUDA; one set serves
every version the tier runs). Both are idempotent (a stamp file per directory) and cached between
runs, so a warm cache downloads nothing; `JETRL_SGLANG_CACHE` moves the cache.
`routes(version)` reads SGLang's route table from its source (no import needed).
"""

from __future__ import annotations

import ast
import fcntl
import os
import subprocess
import sys
from pathlib import Path

NEWEST = "0.5.23"
"""Newest SGLang on PyPI the tier pins (and services/inference emulates)."""
OLDEST = "0.5.19"
"""Oldest SGLang jetrl supports (per-token `weight_versions` in `/generate` replies start here)."""

DEPS = [
    # What `sglang.srt.entrypoints.http_server` imports that the jetrl venv lacks. torch, transformers,
    # numpy, pydantic, starlette, uvicorn, orjson, aiohttp, requests come from the venv; triton,
    # torchvision and soundfile are stubbed by `sglang_app.py` instead.
    "fastapi==0.165.0", "msgspec==0.22.0", "pyzmq==27.3.0", "pybase64==1.5.1", "uvloop==0.23.0",
    "ipython==9.18.1", "traitlets==5.16.1", "compressed-tensors==0.18.0", "sentencepiece==0.2.1",
    "loguru==0.7.3", "gguf==0.19.0", "xgrammar==0.2.7", "apache-tvm-ffi==0.1.11",
    "partial-json-parser==0.2.1.1.post7", "setproctitle==1.3.8",
]

ROOT = Path(__file__).resolve().parents[2]


def versions() -> list[str]:
    """The versions the tier runs: the oldest supported and the newest, or the comma-separated list in
    `JETRL_SGLANG_VERSIONS` (to try the tier against another SGLang, e.g. when moving the floor)."""
    raw = os.environ.get("JETRL_SGLANG_VERSIONS", "")
    return [v.strip() for v in raw.split(",") if v.strip()] or [OLDEST, NEWEST]


def cache_dir() -> Path:
    return Path(os.environ.get("JETRL_SGLANG_CACHE") or ROOT / ".cache" / "sglang")


def _pip_target(target: Path, packages: list[str]) -> Path:
    """Install `packages` into `target` once; a second process (an xdist worker) waits for the first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _pip_target_locked(target, packages)


def _pip_target_locked(target: Path, packages: list[str]) -> Path:
    stamp = target / ".jetrl-installed"
    want = " ".join(packages)
    if stamp.is_file() and stamp.read_text() == want:
        return target
    partial = target.with_name(target.name + ".partial")
    subprocess.run(["rm", "-rf", str(partial)], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--target",
         str(partial), *packages],
        check=True,
    )
    subprocess.run(["rm", "-rf", str(target)], check=True)
    partial.rename(target)
    stamp.write_text(want)
    return target


def install(version: str) -> Path:
    """The directory holding `sglang/` at `version` (downloaded once)."""
    return _pip_target(cache_dir() / version, [f"sglang=={version}"])


def install_deps() -> Path:
    return _pip_target(cache_dir() / "deps", DEPS)


def routes(version: str) -> dict[str, set[str]]:
    """SGLang's HTTP routes at `version`: path -> methods, read from its FastAPI decorators."""
    entry = install(version) / "sglang" / "srt" / "entrypoints"
    table: dict[str, set[str]] = {}
    for name in ("http_server.py", "v1_loads.py"):
        path = entry / name
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                methods = _route(deco)
                if methods is not None:
                    table.setdefault(methods[0], set()).update(methods[1])
    return table


def _route(deco: ast.expr) -> tuple[str, set[str]] | None:
    if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)):
        return None
    owner = deco.func.value
    if not (isinstance(owner, ast.Name) and owner.id in ("app", "router")) or not deco.args:
        return None
    first = deco.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    kind = deco.func.attr
    if kind in ("get", "post", "put", "delete"):
        return first.value, {kind.upper()}
    if kind == "api_route":
        for kw in deco.keywords:
            if kw.arg == "methods" and isinstance(kw.value, ast.List | ast.Tuple):
                return first.value, {str(e.value) for e in kw.value.elts if isinstance(e, ast.Constant)}
        return first.value, {"GET"}
    return None
