"""Helpers for the trainer's integration tests: copy3 trajectories scored like the demo, with
behaviour log-probs from a forward pass of the tiny model, published with the real headers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from schemas.headers import rejection_headers, trajectory_headers
from schemas.messages import PromptTask, RejectionMarker, decode, encode
from schemas.subjects import PROMPTS_STREAM, TRAJECTORIES_STREAM, Subjects
from schemas.trajectory import encode_group, group_to_table
from services.common.demo_task import copy3_reward
from services.common.signing import prompt_tag
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
ISSUER_KEY_ENV = "JETRL_TRAINER__TRUST__PROMPT_ISSUER_KEY"


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
    prompt = [tok.bos_token_id, *tok(f"{digits}=", add_special_tokens=False).input_ids]
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


def issuer_tag(run: str, prompt_id: str) -> str:
    """The tag a prompt issuer gives `prompt_id`, under the key tests/conftest.py gives every test
    trainer (`trust.prompt_issuer_key`): the groups these helpers publish stand for answers to pushed
    prompts, which a trainer trains."""
    return prompt_tag(os.environ[ISSUER_KEY_ENV].encode(), run, prompt_id)


async def publish_group(js: Any, run: str, prompt_id: str, tensors: dict[str, np.ndarray], *, msg_id: str | None = None) -> int:
    """Publish one trajectory message; returns its stream sequence."""
    _, meta = group_to_table(tensors, run=run, prompt_id=prompt_id, worker="test")
    headers = trajectory_headers(meta, issuer_tag(run, prompt_id))
    if msg_id is not None:
        headers["Nats-Msg-Id"] = msg_id
    ack = await js.publish(Subjects(run).trajectories, encode_group(tensors, run=run, prompt_id=prompt_id, worker="test"),
                           headers=headers, stream=TRAJECTORIES_STREAM)
    return ack.seq


async def publish_rejection(js: Any, run: str, prompt_id: str) -> int:
    body = encode(RejectionMarker(run=run, prompt_id=prompt_id, worker="test", reason="all samples failed"))
    headers = rejection_headers(run, prompt_id, issuer_tag(run, prompt_id))
    ack = await js.publish(Subjects(run).trajectories, body, headers=headers, stream=TRAJECTORIES_STREAM)
    return ack.seq


def read_steps(output_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def trained_steps(output_dir: str | Path) -> list[dict[str, Any]]:
    """The trained steps of the trainer's step record (not its start and checkpoint events)."""
    return [r for r in read_steps(output_dir) if "prompt_ids" in r]


def write_dataset(path: Path, n: int) -> Path:
    from services.common.demo_task import write_copy3_dataset

    return write_copy3_dataset(path, n=n, seed=1)


async def take_prompts(js: Any, subject: str, durable: str, n: int) -> list[PromptTask]:
    """Act as the rollout side: pull and ack n prompts off the work queue."""
    sub = await js.pull_subscribe(subject, durable=durable, stream=PROMPTS_STREAM)
    msgs = await sub.fetch(n, timeout=5)
    for m in msgs:
        await m.ack()
    await sub.unsubscribe()
    return [decode(PromptTask, m.data) for m in msgs]


SERVICE_RUN = "resume"
"""The run name of trainer processes started by `start_trainer`."""


def start_trainer(nats_url: str, model: Path, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`python -m services.trainer` as a real process (1 rank, no feeder), in its own process group."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "services.trainer", f"run={SERVICE_RUN}", f"nats_url={nats_url}", f"model_path={model}",
           f"output_dir={out}", "feeder.enabled=false", "batch_groups=2", "eta=100", "checkpoint_every=2",
           "weights.transport=none", "total_steps=6", "fetch_timeout_s=0.2", "log_format=json", *extra]
    log_file = open(out.parent / f"trainer-{len(list(out.parent.glob('trainer-*.log')))}.log", "wb")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_step(pred: Any, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    wait_until("the trainer to reach the expected step", pred, timeout_s=timeout_s, proc=proc)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def until(what: str, check: Any, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll `check()` (a function, or a coroutine function) until it holds; fail early if `proc` exits."""
    import asyncio
    import inspect
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"trainer exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.1)  # the poll interval of a condition


async def delivered_to_trainer(js: Any, run: str, seq: int) -> bool:
    """Whether the trainer's consumer has delivered the stream up to `seq`."""
    info = await js.consumer_info(TRAJECTORIES_STREAM, Subjects(run).trainer_consumer)
    return bool(info.delivered.stream_seq >= seq)


async def stream_groups(js: Any, run: str) -> dict[int, str]:
    """Every trajectory message of the run on the TRAJECTORIES stream: stream sequence -> prompt id."""
    from nats.js.errors import NotFoundError

    from schemas.subjects import HDR_PROMPT_ID

    info = await js.stream_info(TRAJECTORIES_STREAM)
    out: dict[int, str] = {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            msg = await js.get_msg(TRAJECTORIES_STREAM, seq)
        except NotFoundError:
            continue
        if msg.subject == Subjects(run).trajectories and msg.headers:
            out[seq] = msg.headers[HDR_PROMPT_ID]
    return out
