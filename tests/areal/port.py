"""Port AReaL's own files to jetrl mechanically: each `from areal... import name` (and
`tensordict`'s) is rewritten from the import map in docs/compat.md, nothing else is touched. A name
missing from the map is an error naming it: the map is the compatibility contract."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REWRITTEN = ("areal", "tensordict")
"""Top-level modules whose imports the map rewrites."""


class NotInMap(KeyError):
    """An import of AReaL's that the compat table does not map."""


def import_map(doc: Path = ROOT / "docs" / "compat.md") -> dict[str, str]:
    """The ```importmap block of docs/compat.md: AReaL name -> jetrl name."""
    match = re.search(r"```importmap\n(.*?)```", doc.read_text(), re.S)
    if match is None:
        raise ValueError(f"{doc}: no ```importmap block")
    pairs = [line.split() for line in match.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]
    bad = [p for p in pairs if len(p) != 2]
    if bad:
        raise ValueError(f"{doc}: importmap lines must be '<areal name> <jetrl name>': {bad}")
    return {a: j for a, j in pairs}


def _target(full: str, mapping: dict[str, str]) -> tuple[str, str]:
    if full not in mapping:
        raise NotInMap(f"{full} is imported by AReaL's code but not in docs/compat.md's import map")
    module, _, name = mapping[full].rpartition(".")
    return module, name


def rewrite(source: str, mapping: dict[str, str]) -> str:
    """`source` with its AReaL import statements rewritten; every other line as it was."""
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] in REWRITTEN:
            groups: dict[str, list[str]] = {}
            for alias in node.names:
                module, name = _target(f"{node.module}.{alias.name}", mapping)
                local = alias.asname or alias.name
                groups.setdefault(module, []).append(name if name == local else f"{name} as {local}")
            indent = " " * node.col_offset
            text = "".join(f"{indent}from {m} import {', '.join(names)}\n" for m, names in groups.items())
            edits.append((node.lineno - 1, node.end_lineno or node.lineno, text))
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] in REWRITTEN for a in node.names):
            raise NotInMap(f"line {node.lineno}: `import {', '.join(a.name for a in node.names)}` (the map rewrites from-imports)")
    for start, end, text in sorted(edits, reverse=True):
        lines[start:end] = [text]
    return "".join(lines)


def imported_names(source: str) -> list[str]:
    """Every AReaL name `source` imports (`module.name`)."""
    return [f"{node.module}.{a.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and node.module.split(".")[0] in REWRITTEN for a in node.names]


def port(areal_root: Path, files: list[str], dest: Path, package: str = "ported_areal") -> Path:
    """Copy AReaL's `files` (paths under `areal/`) into `dest/<package>/`, imports rewritten, with an
    empty `__init__.py` in each package directory AReaL's own `__init__.py` is not among `files`;
    returns `dest` (put it on sys.path and import `<package>.<path>`)."""
    mapping = import_map()
    for rel in files:
        src = areal_root / "areal" / rel
        out = dest / package / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(rewrite(src.read_text(), mapping))
    for directory in [dest / package, *(p for p in (dest / package).rglob("*") if p.is_dir())]:
        init = directory / "__init__.py"
        if not init.exists():
            init.write_text("")
    return dest
