"""Finding the algorithm a config names: None -> `Standard`; "pkg.module:Name" is imported;
"path/to/file.py:Name" is loaded from that file (a single-file experiment, relative to the working
directory). `Name` may be an instance, or a class (or factory) called as `Name(settings, **kwargs)`
(`Name(**kwargs)` when it takes no positional argument). Every failure names the reference."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from services.trainer.algorithms.api import Algorithm
from services.trainer.algorithms.standard import Standard
from services.trainer.settings import PPOSettings


class AlgorithmError(ValueError):
    """`ppo.algorithm` cannot be used; the message names the reference and what is wrong."""


def load_algorithm(settings: PPOSettings) -> Algorithm:
    if settings.algorithm is None:
        return Standard(settings)
    ref = settings.algorithm
    obj = _make(ref, import_object(ref), settings, settings.algorithm_kwargs)
    missing = [m for m in ("advantages", "loss") if not callable(getattr(obj, m, None))]
    if missing:
        raise AlgorithmError(f"ppo.algorithm {ref!r}: {type(obj).__name__} has no method {', '.join(missing)} "
                             "(subclass services.trainer.algorithms.Standard to keep the built-in one)")
    algorithm: Algorithm = obj
    return algorithm


def import_object(ref: str) -> Any:
    where, sep, attr = ref.rpartition(":")
    if not sep or not where or not attr:
        raise AlgorithmError(f"ppo.algorithm {ref!r}: expected 'pkg.module:Name' or 'path/to/file.py:Name'")
    module = _load_file(ref, Path(where)) if where.endswith(".py") or "/" in where else _import(ref, where)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AlgorithmError(f"ppo.algorithm {ref!r}: {where} has no attribute {attr!r}") from None
    return obj


def _import(ref: str, name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise AlgorithmError(f"ppo.algorithm {ref!r}: cannot import module {name!r}: {exc}") from exc


def _load_file(ref: str, path: Path) -> Any:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise AlgorithmError(f"ppo.algorithm {ref!r}: no such file {path}")
    # A stable module name per file, registered before running it (dataclasses and pickling look it up).
    name = f"jetrl_algorithm_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AlgorithmError(f"ppo.algorithm {ref!r}: cannot load {path} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise AlgorithmError(f"ppo.algorithm {ref!r}: {path} failed to load: {type(exc).__name__}: {exc}") from exc
    return module


def _make(ref: str, obj: Any, settings: PPOSettings, kwargs: dict[str, Any]) -> Any:
    factory: Any = obj
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        if kwargs:
            raise AlgorithmError(f"ppo.algorithm {ref!r} is an instance: ppo.algorithm_kwargs cannot apply")
        return obj
    try:
        params = [p for p in inspect.signature(obj).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        params = []
    try:
        return factory(settings, **kwargs) if params else factory(**kwargs)
    except TypeError as exc:
        raise AlgorithmError(f"ppo.algorithm {ref!r}: cannot construct with ppo.algorithm_kwargs {sorted(kwargs)}: {exc}") from exc
