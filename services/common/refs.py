"""The one resolver of import references named in settings: a workflow, a reward function, an
algorithm, a dataset transform. Accepted spellings:
- `"package.module:Name"` (also `"package.module:Outer.Inner"`),
- `"package.module.Name"` (AReaL's spelling: the last dotted part is the attribute),
- `"path/to/file.py:Name"` (a single-file experiment, loaded once under a private module name).
Errors say which part of the reference failed and why."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


class RefError(ImportError):
    """A reference that does not resolve; the message names the reference and the missing part."""


def resolve_ref(ref: str) -> Any:
    if not isinstance(ref, str) or not ref.strip():
        raise RefError(f"expected an import reference like 'package.module:Name', got {ref!r}")
    ref = ref.strip()
    target, sep, attr = ref.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target):
        module = _load_file(Path(target).expanduser(), ref)
    elif sep:
        module = _import(target, ref)
    else:
        target, dot, attr = ref.rpartition(".")
        if not dot:
            raise RefError(f"{ref!r}: expected 'package.module:Name' or 'package.module.Name'")
        module = _import(target, ref)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RefError(f"{ref!r}: {getattr(module, '__name__', target)} has no attribute {attr!r}") from None
    return obj


def _import(name: str, ref: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise RefError(f"{ref!r}: cannot import module {name!r} ({exc})") from exc


def _load_file(path: Path, ref: str) -> Any:
    if not path.is_file():
        raise RefError(f"{ref!r}: no such file {path}")
    resolved = path.resolve()
    name = f"jetrl_file_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise RefError(f"{ref!r}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
