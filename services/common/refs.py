"""The one resolver of import references named in settings: a workflow, a reward function, an
algorithm, a dataset transform, an agent. Accepted spellings:
- `"package.module:Name"` (also `"package.module:Outer.Inner"`),
- `"package.module.Name"` (AReaL's spelling: the longest importable prefix is the module, the rest
  the attribute path),
- `"path/to/file.py:Name"` (a single-file experiment, loaded once under a private module name).
Errors (`RefError`, an ImportError) say which part failed and why; callers wrap them in their own
error type with the setting's name. Only the standard library is imported here, so a light process
(a reward or agent pool child) can resolve without loading torch."""

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
    if sep:
        if not target or not attr:
            raise RefError(f"{ref!r}: expected 'package.module:Name' or 'package.module.Name'")
        module = _load_file(Path(target).expanduser(), ref) if target.endswith(".py") or "/" in target else _import(target, ref)
        return _attribute(ref, module, target, attr)
    parts = ref.split(".")
    if len(parts) < 2 or not all(parts):
        raise RefError(f"{ref!r}: expected 'package.module:Name' or 'package.module.Name'")
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # only "this prefix is not a module" moves on to a shorter one; a module that exists but
            # fails to import (its own missing dependency) is reported as it is
            if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
                continue
            raise RefError(f"{ref!r}: cannot import module {name!r}: {exc}") from exc
        except (Exception, SystemExit) as exc:  # a module may even sys.exit() at import
            raise RefError(f"{ref!r}: cannot import module {name!r}: {type(exc).__name__}: {exc}") from exc
        return _attribute(ref, module, name, ".".join(parts[cut:]))
    raise RefError(f"{ref!r}: cannot import module {parts[0]!r} (no prefix of the name is a module)")


def _import(name: str, ref: str) -> Any:
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit) as exc:  # a module may even sys.exit() at import
        raise RefError(f"{ref!r}: cannot import module {name!r}: {type(exc).__name__}: {exc}") from exc


def _attribute(ref: str, module: Any, module_name: str, attr: str) -> Any:
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RefError(f"{ref!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


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
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise RefError(f"{ref!r}: {path} failed to load: {type(exc).__name__}: {exc}") from exc
    return module
