"""Finding the algorithm a config names: None -> `Standard`; "pkg.module:Name" is imported;
"path/to/file.py:Name" is loaded from that file (a single-file experiment, relative to the working
directory). `Name` may be an instance, or a class (or factory) called as `Name(settings, **kwargs)`
(`Name(**kwargs)` when it takes no positional argument). Every failure names the reference."""

from __future__ import annotations

import inspect
from typing import Any

from services.common.refs import RefError, resolve_ref
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
    """The object `ppo.algorithm` names ("pkg.module:Name" or "path/to/file.py:Name", `services.common.refs`)."""
    try:
        return resolve_ref(ref)
    except RefError as exc:
        raise AlgorithmError(f"ppo.algorithm {exc}") from exc



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
