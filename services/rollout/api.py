"""The seeds' (AReaL's) workflow API under one import, for workflows ported from AReaL.

    from services.rollout.api import (
        ArealOpenAI, GenerationHyperparameters, InferenceEngine, ModelRequest, ModelResponse,
        RolloutWorkflow, TensorDict, concat_padded_tensors, workflow_context,
    )

replaces `areal.api.workflow_api`, `areal.api.io_struct`, `areal.api.cli_args`,
`areal.experimental.openai`, `areal.utils.data` and `tensordict` in a workflow's imports; the rest of
the workflow stays as written. docs/compat.md maps every name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from services.rollout.engine import ModelRequest, ModelResponse
from services.rollout.engine_api import InferenceEngine
from services.rollout.gconfig import GenerationHyperparameters
from services.rollout.tensors import concat_padded
from services.rollout.workflow import GroupedRolloutWorkflow, RolloutWorkflow, workflow_context

if TYPE_CHECKING:
    from services.rollout.agent.direct import ArealOpenAI

__all__ = [
    "ArealOpenAI",
    "GenerationHyperparameters",
    "GroupedRolloutWorkflow",
    "InferenceEngine",
    "ModelRequest",
    "ModelResponse",
    "RolloutWorkflow",
    "TensorDict",
    "concat_padded_tensors",
    "workflow_context",
]


class TensorDict(dict[str, Any]):
    """`tensordict.TensorDict(res, batch_size=[n])` as AReaL workflows build one: a plain dict of
    tensors (what jetrl's workflows return). `batch_size` is checked against the tensors' first
    dimension, so a wrong batch is caught where it is made."""

    def __init__(self, source: Mapping[str, Any] | None = None, batch_size: Any = None, **kwargs: Any) -> None:
        super().__init__(dict(source or {}), **kwargs)
        if batch_size is not None:
            size = list(batch_size) if not isinstance(batch_size, int) else [batch_size]
            for key, value in self.items():
                shape = list(getattr(value, "shape", []))
                if shape[: len(size)] != size:
                    raise ValueError(f"TensorDict: {key} has shape {shape}, not batch_size {size}")
        self.batch_size = batch_size


def concat_padded_tensors(tensor_dicts: list[Mapping[str, Any]], pad_value: float = 0.0) -> dict[str, Any]:
    """AReaL's `concat_padded_tensors`: samples stacked along the batch, right-padded to the longest
    (jetrl pads with 0 only, as the trajectory contract stores no padding)."""
    if pad_value != 0.0:
        raise ValueError("concat_padded_tensors: only pad_value=0 is supported (padding is not stored)")
    return concat_padded([dict(t) for t in tensor_dicts])


def __getattr__(name: str) -> Any:
    # lazy: the direct client pulls in the proxy's modules and the openai SDK
    if name == "ArealOpenAI":
        from services.rollout.agent.direct import ArealOpenAI

        return ArealOpenAI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
