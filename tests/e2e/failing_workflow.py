"""A workflow whose every episode fails, as a researcher's first try often does (the e2e tests name it
in `rollout.workflow`)."""

from __future__ import annotations

from typing import Any

from services.rollout.workflow import RolloutWorkflow


class PromptIdsWorkflow(RolloutWorkflow):
    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        return {"input_ids": data["prompt_ids"]}  # the dataset has no prompt_ids: KeyError every time
