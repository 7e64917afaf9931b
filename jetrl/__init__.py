"""jetrl's public researcher API: everything a workflow, a reward function or an algorithm in a
single file needs, under one import. The names follow the seeds (AReaL-lite), so a workflow written
for AReaL runs with only its import lines changed (docs/compat.md).

    import jetrl
    from jetrl import RolloutWorkflow, ModelRequest, GenerationHyperparameters, concat_padded_tensors

What is here is public and stable: it changes only with a deprecation period and a note in
docs/api.md. Anything imported from `services.*` or `schemas.*` is internal and may move.

This module re-exports and holds no logic; names are imported on first use, so `import jetrl` stays
light (torch is loaded only by the names that need it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> module that defines it
_EXPORTS: dict[str, str] = {
    # the workflow API
    "RolloutWorkflow": "services.rollout.workflow",
    "GroupedRolloutWorkflow": "services.rollout.workflow",
    "WorkflowError": "services.rollout.workflow",
    "workflow_context": "services.rollout.workflow",
    # requests to the inference engine, and what comes back
    "InferenceEngine": "services.rollout.engine_api",  # the protocol; the SGLang client is one implementation
    "ModelRequest": "services.rollout.io_struct",
    "ModelResponse": "services.rollout.io_struct",
    "GenerationHyperparameters": "services.rollout.gconfig",
    # tensor helpers: one sample's tensors, a group padded together
    "TensorDict": "services.rollout.api",
    "concat_padded_tensors": "services.rollout.api",
    "concat_padded": "services.rollout.tensors",
    "sample_tensors": "services.rollout.tensors",
    "turn_tensors": "services.rollout.tensors",
    # rewards and prompts inside a workflow
    "encode_chat": "services.rollout.workflows.common",
    "reward_items": "services.rollout.workflows.common",
    "score": "services.rollout.workflows.common",
    # agents: the direct client (AReaL's ArealOpenAI)
    "ArealOpenAI": "services.rollout.agent.direct",
    "InteractionWithTokenLogpReward": "services.rollout.compat.interaction",
    # the algorithm API (docs/algorithms.md)
    "Algorithm": "services.trainer.algorithms.api",
    "AdvantageInput": "services.trainer.algorithms.api",
    "LossInput": "services.trainer.algorithms.api",
    "LossOutput": "services.trainer.algorithms.api",
    "Standard": "services.trainer.algorithms.standard",
    "PPOSettings": "services.trainer.settings",
    # AReaL's helpers, as its workflows, rewards and agents import them (docs/compat.md)
    "AsyncRewardWrapper": "services.rollout.compat.reward",
    "import_from_string": "services.rollout.compat.helpers",
    "apply_chat_template": "services.rollout.compat.helpers",
    "load_hf_tokenizer": "services.rollout.compat.helpers",
    # naming things in settings ("pkg.mod:Name", "pkg.mod.Name", "file.py:Name")
    "resolve_ref": "services.common.refs",
}

__all__ = [
    "AdvantageInput",
    "Algorithm",
    "ArealOpenAI",
    "AsyncRewardWrapper",
    "GenerationHyperparameters",
    "GroupedRolloutWorkflow",
    "InferenceEngine",
    "InteractionWithTokenLogpReward",
    "LossInput",
    "LossOutput",
    "ModelRequest",
    "ModelResponse",
    "PPOSettings",
    "RolloutWorkflow",
    "Standard",
    "TensorDict",
    "WorkflowError",
    "apply_chat_template",
    "concat_padded",
    "concat_padded_tensors",
    "encode_chat",
    "import_from_string",
    "load_hf_tokenizer",
    "resolve_ref",
    "reward_items",
    "sample_tensors",
    "score",
    "turn_tensors",
    "workflow_context",
]


#: AReaL's utility modules, under the same names: `from jetrl import stats_tracker, logging, perf_tracer`
_MODULES: dict[str, str] = {
    "stats_tracker": "jetrl.stats_tracker",
    "logging": "jetrl.logging",
    "perf_tracer": "jetrl.perf_tracer",
}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jetrl' has no attribute {name!r} (public names: {', '.join(__all__)})")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return [*__all__, *_MODULES]


if TYPE_CHECKING:
    from services.common.refs import resolve_ref
    from services.rollout.agent.direct import ArealOpenAI
    from services.rollout.api import TensorDict, concat_padded_tensors
    from services.rollout.compat.helpers import apply_chat_template, import_from_string, load_hf_tokenizer
    from services.rollout.compat.interaction import InteractionWithTokenLogpReward
    from services.rollout.compat.reward import AsyncRewardWrapper
    from services.rollout.engine_api import InferenceEngine
    from services.rollout.gconfig import GenerationHyperparameters
    from services.rollout.io_struct import ModelRequest, ModelResponse
    from services.rollout.tensors import concat_padded, sample_tensors, turn_tensors
    from services.rollout.workflow import GroupedRolloutWorkflow, RolloutWorkflow, WorkflowError, workflow_context
    from services.rollout.workflows.common import encode_chat, reward_items, score
    from services.trainer.algorithms.api import AdvantageInput, Algorithm, LossInput, LossOutput
    from services.trainer.algorithms.standard import Standard
    from services.trainer.settings import PPOSettings
