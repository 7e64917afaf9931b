"""`workflow_kwargs` as AReaL's configs write them: a callable may be given as a reference string
(`"pkg.mod:name"`, or AReaL's dotted `"pkg.mod.name"`), and is resolved here for each constructor
parameter annotated as a callable that does not also take a string (a parameter typed
`Callable | str`, as AReaL's `RLVRWorkflow.reward_fn` is, resolves the string itself), and for each
parameter with no annotation whose name ends in `_fn` (AReaL's naming of functions: the unannotated
`reward_fn` of its direct-client `multi_turn_v2.MultiTurnWorkflow`). jetrl adds
nothing to a user's kwargs that the user did not write (`service.build_workflow` says which
standard values it offers, and when)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from services.common.refs import RefError, resolve_ref
from services.rollout.workflow import WorkflowError


def _signature(target: Any) -> inspect.Signature | None:
    for eval_str in (True, False):
        try:
            return inspect.signature(target, eval_str=eval_str)
        except (TypeError, ValueError, NameError):
            continue
        except Exception:  # an annotation that fails to evaluate
            continue
    return None


def wants_callable(annotation: Any) -> bool:
    """Whether a parameter annotation asks for a callable and not (also) a string."""
    if annotation is inspect.Parameter.empty:
        return False
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return "Callable" in text and "str" not in text.replace("Callable", "")


def names_a_function(name: str, annotation: Any) -> bool:
    """Whether a string given for parameter `name` (annotated `annotation`) is a reference to resolve."""
    if annotation is inspect.Parameter.empty:
        return name.endswith("_fn")
    return wants_callable(annotation)


def resolve_callable_kwargs(target: Any, kwargs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`kwargs` with each string given for a callable parameter of `target` resolved to the object it names."""
    out = dict(kwargs)
    sig = _signature(target)
    if sig is None:
        return out
    for name, param in sig.parameters.items():
        value = out.get(name)
        if isinstance(value, str) and names_a_function(name, param.annotation):
            try:
                out[name] = resolve_ref(value)
            except RefError as exc:
                raise WorkflowError(f"{where}.{name}: {exc}") from exc
            if not callable(out[name]):
                raise WorkflowError(f"{where}.{name}: {value!r} names a {type(out[name]).__name__}, not a callable")
    return out
