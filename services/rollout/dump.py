"""`dump_to_file`: one JSONL line per sample of each trajectory, for reading what the model wrote.

AReaL's `dump_to_file` / `fileroot`, same layout and fields. Path:
`{fileroot}/{experiment_name}/{trial_name}/{rollout|eval-rollout}/{version}/{task_id}.jsonl`, where
`version` is the group's head version (the oldest weights that produced a trained token; 0 if none
did). One line per sample: `task_id`, `sample_idx`, `seqlen`, `prompt_len`, `head_version`,
`tail_version` (over the trained tokens, as staleness is judged), `reward`, `prompt`, `completion`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

Decode = Callable[[Sequence[int]], str]


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _ids_as_text(ids: Sequence[int]) -> str:
    return " ".join(str(i) for i in ids)


def _version_span(versions: np.ndarray, trained: np.ndarray) -> tuple[int, int]:
    """Over the trained tokens only: a prompt tagged 0 (AReaL's examples) or -1 does not count."""
    generated = versions[trained]
    return (int(generated.min()), int(generated.max())) if generated.size else (-1, -1)


def dump_records(task_id: str, tensors: dict[str, Any], decode: Decode | None = None) -> list[dict[str, Any]]:
    """The JSONL records of one group, one per sample."""
    decode = decode or _ids_as_text
    ids = _numpy(tensors["input_ids"])
    mask = _numpy(tensors["attention_mask"]).astype(bool)
    loss = _numpy(tensors["loss_mask"]) != 0
    versions = _numpy(tensors["versions"])
    rewards = _numpy(tensors["rewards"])
    prompt_lens = _numpy(tensors["prompt_len"]) if "prompt_len" in tensors else None
    records = []
    for i in range(ids.shape[0]):
        seqlen = int(mask[i].sum())
        if prompt_lens is not None:
            prompt_len = int(prompt_lens[i])
        else:
            prompt_len = int(loss[i].argmax()) if loss[i].any() else seqlen
        head, tail = _version_span(versions[i, :seqlen], loss[i, :seqlen])
        records.append(
            {
                "task_id": task_id,
                "sample_idx": i,
                "seqlen": seqlen,
                "prompt_len": prompt_len,
                "head_version": head,
                "tail_version": tail,
                "reward": float(rewards[i]),
                "prompt": decode(ids[i, :prompt_len].tolist()),
                "completion": decode(ids[i, prompt_len:seqlen].tolist()),
            }
        )
    return records


class TrajectoryDumper:
    def __init__(self, fileroot: str | Path, experiment: str, trial: str, decode: Decode | None = None) -> None:
        self.root = Path(fileroot) / experiment / trial
        self.decode = decode

    def path(self, task_id: str, version: int, is_eval: bool) -> Path:
        scope = "eval-rollout" if is_eval else "rollout"
        safe_id = task_id.replace("/", "_")
        return self.root / scope / str(version) / f"{safe_id}.jsonl"

    def write(self, task_id: str, tensors: dict[str, Any], is_eval: bool) -> Path:
        records = dump_records(task_id, tensors, self.decode)
        head = min((r["head_version"] for r in records if r["head_version"] >= 0), default=0)
        path = self.path(task_id, head, is_eval)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:  # a redelivered prompt appends: the file shows every attempt
            for record in records:
                f.write(json.dumps(record) + "\n")
        return path

    async def awrite(self, task_id: str, tensors: dict[str, Any], is_eval: bool) -> Path:
        return await asyncio.to_thread(self.write, task_id, tensors, is_eval)
