"""What the device check imports beyond the standard library: an AST walk from its entry files through
every jetrl module they import (at module level or inside functions, since a lazy import runs too),
collecting the top-level names of the third-party modules reached. No module is imported."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWN = ("jetrl", "schemas", "services", "tests", "bench", "infra")
ENTRIES = ["tests/gpu/test_cuda.py", "tests/gpu/one_update.py", "tests/gpu/test_up_cuda.py", "tests/conftest.py", "bench/gpu.py",
           "services/inference/__main__.py", "services/inference/server.py",
           # `jetrl up device=cuda` (tests/gpu/test_up_cuda.py): up itself, and what it starts by module name
           # (`python -m services.<name>`) or loads by dotted name (the demo's workflow and reward), which no import names
           "services/up/__main__.py", "services/up/run.py", "services/trainer/__main__.py", "services/reward/__main__.py",
           "services/rollout/__main__.py", "services/weights/__main__.py", "services/rollout/workflows/rlvr.py",
           "services/reward/builtin.py"]
"""What the device runs: the GPU tests (and pytest's conftest), the GPU bench, the inference server they
start, and the stack `jetrl up` starts."""


def _module_file(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path, package: str) -> set[str]:
    """Absolute names of every module `path` imports."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, node.module] if node.module else parts)
            else:
                base = node.module or ""
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def third_party(entries: list[str] = ENTRIES) -> dict[str, str]:
    """{top-level module name: the first jetrl file that imports it}, standard library left out."""
    seen: set[Path] = set()
    found: dict[str, str] = {}
    todo = [ROOT / e for e in entries]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        rel = path.relative_to(ROOT)
        package = ".".join(rel.with_suffix("").parts[:-1] if rel.name != "__init__.py" else rel.parent.parts)
        for name in _imports(path, package):
            top = name.split(".")[0]
            if top in OWN:
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # the package's __init__ files run too
                    if (f := _module_file(".".join(parts[:i]))) is not None:
                        todo.append(f)
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, str(rel))
    return found


if __name__ == "__main__":
    for name, where in sorted(third_party().items()):
        print(f"{name:<20} {where}")
