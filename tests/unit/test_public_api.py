"""The public researcher API: `import jetrl` is light, every public name resolves, and the examples a
researcher copies import from `jetrl` only (anything under services/ or schemas/ is internal)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import jetrl

ROOT = Path(__file__).resolve().parents[2]


def test_import_jetrl_is_light() -> None:
    code = "import sys, jetrl; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("name", jetrl.__all__)
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(jetrl, name) is not None


def test_an_unknown_name_says_what_is_public() -> None:
    with pytest.raises(AttributeError, match=r"public names: .*RolloutWorkflow"):
        jetrl.NoSuchThing  # noqa: B018


def test_examples_and_seed_workflows_import_only_from_jetrl() -> None:
    files = [*ROOT.glob("examples/*.py"), *ROOT.glob("tests/seed_workflows/*.py")]
    assert files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            internal = [m for m in modules if m.split(".")[0] in ("services", "schemas")]
            assert not internal, f"{path.relative_to(ROOT)} imports {internal}: use `jetrl`"
