"""How a reward function is called: by its signature. The item offers `prompt`, `completion`,
`prompt_ids`, `completion_ids` and the row's fields; AReaL's workflows pass the completion's text as
`completions`, so a function that names that parameter gets it under that name. A function without
`**kwargs` gets only the fields it names (passing the others would fail every item with a TypeError);
one that names a field the item lacks and has no default is an error that says which."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

COMPLETION_ALIASES = ("completion", "completions")
"""Names a function may give the completion's text: ours, and AReaL's."""


class CallError(TypeError):
    """The item cannot be passed to this function (a required parameter it has no value for)."""


@dataclass(frozen=True)
class Caller:
    fn: Callable[..., Any]
    names: frozenset[str] | None
    """Keyword parameters the function takes; None when it takes **kwargs (any name)."""
    required: tuple[str, ...]
    """Parameters without a default that can be passed by keyword."""
    completion_names: tuple[str, ...]
    """Under which names the completion's text goes in."""
    positional_only: tuple[str, ...]
    """Parameters that cannot be passed by keyword (`def f(prompt, completion, /)`): filled in order."""

    def __call__(self, kwargs: dict[str, Any]) -> Any:
        kwargs = dict(kwargs)
        completion = kwargs.pop("completion", None)
        for name in self.completion_names:
            kwargs[name] = completion
        missing = [name for name in self.positional_only if name not in kwargs]
        if missing:
            raise CallError(f"it takes positional-only {', '.join(repr(m) for m in missing)}, which the item does not have")
        args = [kwargs.pop(name) for name in self.positional_only]
        if self.names is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.names}
        missing = [name for name in self.required if name not in kwargs]
        if missing:
            raise CallError(
                f"it needs {', '.join(repr(m) for m in missing)}, which the item does not have "
                f"(it has prompt, completion, prompt_ids, completion_ids and the row's fields)"
            )
        return self.fn(*args, **kwargs)


def caller(fn: Callable[..., Any]) -> Caller:
    """Read `fn`'s signature once; a callable without one (some builtins) gets every field."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return Caller(fn, None, (), ("completion",), ())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    by_name = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    names = {p.name for p in by_name}
    named = tuple(n for n in COMPLETION_ALIASES if n in names)
    positional_only = tuple(p.name for p in params if p.kind is p.POSITIONAL_ONLY)
    if "completion" in positional_only:
        named = ("completion",)
    elif not named:
        # only **kwargs: give both names, so `kwargs["completion"]` and `kwargs["completions"]` work
        named = COMPLETION_ALIASES if var_kw else ()
    required = tuple(p.name for p in by_name if p.default is p.empty)
    return Caller(fn, None if var_kw else frozenset(names), required, named, positional_only)
