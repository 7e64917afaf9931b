"""A workflow with no model: it waits `delay_s`, then returns a fixed-shape group built from the
prompt's characters. It exercises everything around the model (bus, retries, rejections, kills)
and measures the pipeline's own overhead.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from services.rollout.engine_api import InferenceEngine
from services.rollout.tensors import TensorDict, concat_padded, sample_tensors
from services.rollout.workflow import RolloutWorkflow, workflow_context


class EpisodeFailed(RuntimeError):
    """The synthetic failure (`fail="always"`)."""


class SyntheticWorkflow(RolloutWorkflow):
    def __init__(
        self,
        group_size: int = 4,
        completion_len: int = 8,
        delay_s: float = 0.0,
        fail: str = "never",
        reject: bool = False,
        marker_dir: str | None = None,
    ) -> None:
        """`fail`: "never" | "always" (every episode raises); `reject`: every episode returns None;
        `marker_dir`: touch `<marker_dir>/<task_id>.<pid>` when an episode starts, so a test can
        see where an episode runs."""
        if fail not in ("never", "always"):
            raise ValueError(f"fail must be 'never' or 'always', got {fail!r}")
        self.group_size = group_size
        self.completion_len = completion_len
        self.delay_s = delay_s
        self.fail = fail
        self.reject = reject
        self.marker_dir = Path(marker_dir) if marker_dir else None

    async def arun_episode(self, engine: InferenceEngine | None, data: dict[str, Any]) -> TensorDict | None:  # it asks no engine
        if self.marker_dir is not None:
            self.marker_dir.mkdir(parents=True, exist_ok=True)
            (self.marker_dir / f"{workflow_context.prompt_id}.{os.getpid()}").touch()
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        if self.fail == "always":
            raise EpisodeFailed(f"synthetic failure for {data.get('id', '?')}")
        if self.reject:
            return None
        prompt = [ord(c) % 48 for c in str(data.get("prompt", ""))] or [0]
        samples = []
        for i in range(self.group_size):
            n = 1 + (self.completion_len + i) % (self.completion_len + 1)  # ragged lengths, never 0
            out = [(prompt[0] + i + k) % 48 for k in range(n)]
            samples.append(sample_tensors(prompt, out, [-0.5] * n, [0] * n, reward=float(i % 2)))
        return concat_padded(samples)
