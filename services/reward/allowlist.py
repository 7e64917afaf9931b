"""Which reward functions a request may name. A reference is `module:function`; the list holds exact
references and module patterns (`pkg.mod:*` for one module's functions, `pkg.*:*` for any module
under `pkg`). Nothing outside the list is imported or called, so a caller cannot run arbitrary code."""

from __future__ import annotations

import re

BUILTIN_REFS = (
    "services.reward.builtin:copy3",
    "services.reward.builtin:exact_match",
    "services.reward.builtin:numeric_match",
    "services.reward.builtin:math_verify",
)

_MODULE = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_REF_RE = re.compile(rf"^({_MODULE}):([A-Za-z_][A-Za-z0-9_]*)$")
_MODULE_PATTERN_RE = re.compile(rf"^({_MODULE}):\*$")
_PACKAGE_PATTERN_RE = re.compile(rf"^({_MODULE})\.\*:\*$")


class NotAllowedError(ValueError):
    """A reference that is malformed or not on the allow-list."""


def parse_ref(ref: str) -> tuple[str, str]:
    """`"pkg.mod:fn"` -> `("pkg.mod", "fn")`; raise `NotAllowedError` naming the expected form."""
    m = _REF_RE.match(ref)
    if not m:
        raise NotAllowedError(f"reward function {ref!r} is not a reference of the form 'module:function'")
    return m.group(1), m.group(2)


class AllowList:
    def __init__(self, entries: list[str]) -> None:
        self.exact: set[str] = set()
        self.modules: set[str] = set()
        self.packages: set[str] = set()
        for entry in entries:
            entry = entry.strip()
            if m := _MODULE_PATTERN_RE.match(entry):
                self.modules.add(m.group(1))
            elif m := _PACKAGE_PATTERN_RE.match(entry):
                self.packages.add(m.group(1))
            elif _REF_RE.match(entry):
                self.exact.add(entry)
            else:
                raise ValueError(
                    f"allow-list entry {entry!r}: expected 'module:function', 'module:*' or 'package.*:*'"
                )

    def check(self, ref: str) -> tuple[str, str]:
        """Return (module, function) if `ref` is allowed, else raise `NotAllowedError` saying why."""
        module, func = parse_ref(ref)
        if func.startswith("_"):
            raise NotAllowedError(f"reward function {ref!r}: private names (leading '_') cannot be called")
        if ref in self.exact or module in self.modules:
            return module, func
        if any(module.startswith(p + ".") for p in self.packages):
            return module, func
        raise NotAllowedError(
            f"reward function {ref!r} is not on this reward service's allow-list "
            f"(add it with allow=[...] in the reward settings; allowed now: {self.describe()})"
        )

    def describe(self) -> str:
        parts = sorted(self.exact) + sorted(f"{m}:*" for m in self.modules) + sorted(f"{p}.*:*" for p in self.packages)
        return ", ".join(parts) or "(nothing)"

    def preload_modules(self) -> list[str]:
        """Modules whose functions are named outright: worth importing when a pool process starts."""
        return sorted({ref.partition(":")[0] for ref in self.exact} | self.modules)
