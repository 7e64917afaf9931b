"""The inference engine as a workflow sees it: an interface, apart from its implementations (as
AReaL's `areal/api/engine_api.py` keeps it). `jetrl.InferenceEngine` is this protocol; jetrl's
SGLang client over aiohttp (`services.rollout.engine.SGLangClient`) is one implementation, and a
workflow typed against the protocol runs with any other (a recording wrapper, a test's engine)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from services.rollout.io_struct import ModelRequest, ModelResponse


@runtime_checkable
class InferenceEngine(Protocol):
    """What `RolloutWorkflow.arun_episode(engine, data)` may call on its engine."""

    async def agenerate(self, req: ModelRequest, *, episode: str | None = None) -> ModelResponse:
        """One completion of `req` (AReaL's `agenerate`). `episode`: requests of one episode (a
        group, a conversation) go to one server while it is up, for its prefix cache. Interruptible:
        a weight update during the generation continues it, so its tokens may carry several weight
        versions (`ModelResponse.output_versions`)."""
        ...

    def release_episode(self, episode: str) -> None:
        """The episode is over: forget which server it was on."""
        ...
