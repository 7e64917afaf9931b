"""Make SGLang's HTTP app importable on a CPU-only machine, at every version the tier runs.

The app's import chain reaches GPU-only packages (triton, sgl_kernel) and media packages (torchvision,
soundfile) that jetrl's venv lacks, and was written against the torch and transformers of its day. No
SGLang code is used for this (older wheels carry no platform stubs of their own), so one mechanism
serves every version:

- `triton` is an inert module for every importer: torch itself imports it once it is in
  `sys.modules`, so the stub has the few real-looking names torch's Inductor reads at import (a
  `Config` class, exception classes, `triton_key`, `tl.constexpr`); nothing ever compiles a kernel.
- `sgl_kernel`, `torchvision`, `soundfile` are inert modules offered only to imports made from
  SGLang's own files, so transformers still sees them as absent and keeps its CPU paths.
- Version skew with the venv: `torch._C._cpu._is_amx_tile_supported` (gone from newer torch, called
  at import by SGLang before 0.5.14) answers False; `AutoConfig.register` allows SGLang to register a
  config name that newer transformers already ships (SGLang 0.5.14-0.5.19 register `qwen3_asr`).

An inert module answers every attribute with another inert module (a class for a capitalised name,
an exception class for `...Error`), and used as a decorator returns the function unchanged.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from typing import Any

FOR_EVERYONE = ("triton",)
FOR_SGLANG = ("sgl_kernel", "torchvision", "soundfile")


def sglang_dir() -> str:
    """The `sglang` package directory on sys.path (the wheel the tier installed)."""
    for entry in sys.path:
        if os.path.isfile(os.path.join(entry, "sglang", "version.py")):
            return os.path.join(os.path.abspath(entry), "sglang")
    raise SystemExit("sglang is not on PYTHONPATH")


class _Stub:
    """Base of every class an inert module hands out (so `class K(triton.X):` works)."""


class Inert(types.ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        value: Any
        if name[:1].isupper():
            base = Exception if name.endswith(("Error", "Resources")) else _Stub
            value = type(name, (base,), {"__module__": self.__name__})
        else:
            value = Inert(full)
        setattr(self, name, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @triton.jit
        return lambda fn: fn  # @triton.autotune(...)

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Any:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __contains__(self, item: object) -> bool:
        return False


class _Config:
    def __init__(self, kwargs: dict | None = None, num_warps: int = 4, num_stages: int = 2, **extra: Any) -> None:
        self.kwargs, self.num_warps, self.num_stages = kwargs or {}, num_warps, num_stages


class _Constexpr:
    def __init__(self, value: Any = None) -> None:
        self.value = value


def _triton(name: str) -> Inert:
    mod = Inert(name)
    if name == "triton":
        mod.__version__ = "3.0.0"  # type: ignore[attr-defined]
        mod.cdiv = lambda a, b: -(a // -b)  # type: ignore[attr-defined]
        mod.next_power_of_2 = lambda n: 1 << (n - 1).bit_length() if n > 0 else 1  # type: ignore[attr-defined]
        mod.Config = _Config  # type: ignore[attr-defined]
    elif name == "triton.language":
        mod.constexpr = _Constexpr  # type: ignore[attr-defined]
    elif name in ("triton.runtime.cache", "triton.compiler.compiler"):
        mod.triton_key = lambda: "triton-stub"  # type: ignore[attr-defined]
    elif name == "triton.runtime.jit":
        mod.JITFunction = type("JITFunction", (), {})  # type: ignore[attr-defined]
    return mod


class _Loader:
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Inert:
        return _triton(spec.name) if spec.name.split(".")[0] in FOR_EVERYONE else Inert(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Finder:
    def __init__(self, sglang: str) -> None:
        self.sglang = sglang

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        top = fullname.split(".")[0]
        if top in FOR_EVERYONE or (top in FOR_SGLANG and self._from_sglang()):
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None

    def _from_sglang(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen") or "importlib" in frame.f_code.co_filename):
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename.startswith(self.sglang)


def install() -> None:
    """Before the first `import sglang...`: the stubs and the venv-skew shims above."""
    import torch
    from transformers import AutoConfig

    if not hasattr(torch._C._cpu, "_is_amx_tile_supported"):
        torch._C._cpu._is_amx_tile_supported = lambda: False
    register = AutoConfig.register

    def register_over(model_type: str, config: Any, exist_ok: bool = False) -> None:
        register(model_type, config, exist_ok=True)

    AutoConfig.register = register_over  # type: ignore[method-assign]
    sys.meta_path.insert(0, _Finder(sglang_dir()))
