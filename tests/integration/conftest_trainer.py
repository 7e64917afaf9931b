"""Helpers for the trainer's integration tests: copy3 trajectories scored like the demo, with
behaviour log-probs from a forward pass of the tiny model, published with the real headers."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from schemas.headers import rejection_headers, trajectory_headers
from schemas.messages import RejectionMarker, encode
from schemas.subjects import TRAJECTORIES_STREAM, Subjects
from schemas.trajectory import encode_group, group_to_table
from services.common.demo_task import copy3_reward


@lru_cache(maxsize=2)
def _model_and_tokenizer(model_path: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_path).eval(), AutoTokenizer.from_pretrained(model_path)


def make_group(model_path: str | Path, digits: str, *, group_size: int = 4, version: int = 0, seed: int = 0) -> dict[str, np.ndarray]:
    """A copy3 group: prompt `<bos>ddd=`, random 3-digit completions + <eos>, rewards from copy3_reward,
    logprobs from the model at `model_path` (the behaviour policy), every token tagged `version`."""
    import torch

    model, tok = _model_and_tokenizer(str(model_path))
    rng = np.random.default_rng(seed)
    prompt = [tok.bos_token_id] + tok(f"{digits}=", add_special_tokens=False).input_ids
    rows, rewards = [], []
    for i in range(group_size):
        completion = "".join(rng.choice(list("0123456789"), size=3)) if i else digits[:2] + "0"
        rows.append(prompt + tok(completion, add_special_tokens=False).input_ids + [tok.eos_token_id])
        rewards.append(copy3_reward(completion, digits))
    ids = np.array(rows, dtype=np.int64)
    loss_mask = np.zeros_like(ids)
    loss_mask[:, len(prompt):] = 1
    with torch.no_grad():
        logits = model(torch.from_numpy(ids)).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.from_numpy(ids[:, 1:, None])).squeeze(-1)
    logprobs = np.zeros(ids.shape, dtype=np.float32)
    logprobs[:, 1:] = lp.numpy() * loss_mask[:, 1:]
    return {
        "input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": loss_mask, "logprobs": logprobs,
        "rewards": np.array(rewards, dtype=np.float32), "versions": np.where(loss_mask > 0, version, -1).astype(np.int64),
    }


async def publish_group(js: Any, run: str, prompt_id: str, tensors: dict[str, np.ndarray], *, msg_id: str | None = None) -> int:
    """Publish one trajectory message; returns its stream sequence."""
    _, meta = group_to_table(tensors, run=run, prompt_id=prompt_id, worker="test")
    headers = trajectory_headers(meta)
    if msg_id is not None:
        headers["Nats-Msg-Id"] = msg_id
    ack = await js.publish(Subjects(run).trajectories, encode_group(tensors, run=run, prompt_id=prompt_id, worker="test"),
                           headers=headers, stream=TRAJECTORIES_STREAM)
    return ack.seq


async def publish_rejection(js: Any, run: str, prompt_id: str) -> int:
    body = encode(RejectionMarker(run=run, prompt_id=prompt_id, worker="test", reason="all samples failed"))
    ack = await js.publish(Subjects(run).trajectories, body, headers=rejection_headers(run, prompt_id), stream=TRAJECTORIES_STREAM)
    return ack.seq


def read_steps(output_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_dataset(path: Path, n: int) -> Path:
    from services.common.demo_task import write_copy3_dataset

    return write_copy3_dataset(path, n=n, seed=1)
