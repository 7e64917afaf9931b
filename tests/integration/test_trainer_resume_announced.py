"""A trainer killed after it announced a version newer than its last checkpoint trains again after
`--resume auto`. A real nats-server, a real CPU inference server with its weights agent, a rollout
worker with the seed RLVR workflow (copy3 reward), and trainer processes with a feeder publishing
weights:

1. the first trainer trains 2 steps and ends (checkpoint at version 2);
2. a second one resumes from it, publishes version 3 or later and is killed (SIGKILL: no checkpoint);
3. a third one resumes from the version-2 checkpoint while the servers serve the second one's last
   version N. It publishes its restored weights as N+1 and counts from there: it trains its remaining
   steps (the step count goes on from the checkpoint's) on groups generated with its own weights.
Before, it trained on from version 2: it announced versions 3..N again with other weights (a server
that held the number kept the killed trainer's weights), and trained groups generated with the killed
trainer's lost weights as its own."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import numpy as np
import pytest

from schemas.headers import trajectory_headers
from schemas.subjects import TRAJECTORIES_STREAM
from schemas.trajectory import decode_group, encode_group_with_meta
from services.common.nats_server import free_port
from services.rollout.client_settings import InferenceClientSettings
from services.rollout.engine import InferenceEngine
from services.rollout.service import build_workflow, standard_kwargs
from services.rollout.settings import RolloutSettings
from services.status.groups import render_groups, trainer_groups
from services.trainer.feed.ledger import PromptLedger
from services.trainer.intake.intake import Intake
from services.trainer.versions import VersionWindow
from services.weights.sender.publisher import ensure_weight_sync_stream, latest_published
from tests.integration.test_seed_workflows import rows
from tests.seed_workflows.rewards import copy3_reward_fn
from tests.support.rollout import running_worker
from tests.support.trainer import REPO, kill_group, read_steps, until
from tests.support.weights import Stack, process, wait_healthy

RUN = "crashed"
PROCESS_TIMEOUT_S = 300.0
"""Generous: the machine may be shared (a trainer's start alone is DeepSpeed's init)."""


def start(nats_url: str, model: Path, out: Path, dataset: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`python -m services.trainer` with a feeder, publishing weights to the object store (1 rank)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "services.trainer", f"run={RUN}", f"nats_url={nats_url}", f"model_path={model}",
           f"output_dir={out}", f"feeder.dataset_path={dataset}", "feeder.max_in_flight=4", "batch_groups=2", "eta=1",
           "checkpoint_every=0", "fetch_timeout_s=0.2", "log_format=json", *extra]
    log = open(out.parent / f"trainer-{len(list(out.parent.glob('trainer-*.log')))}.log", "wb")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def ended(proc: subprocess.Popen[bytes], what: str, log: Path) -> int:
    try:
        await until(what, lambda: proc.poll() is not None, PROCESS_TIMEOUT_S)
    except TimeoutError:
        kill_group(proc)
        pytest.fail(f"{what}: not within {PROCESS_TIMEOUT_S} s; the trainer's last lines:\n{_tail(log)}")
    return proc.returncode


def _tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-15:])


@contextlib.asynccontextmanager
async def rollout(nc: Any, tiny_model: Path, url: str) -> AsyncIterator[None]:
    """A rollout worker of the run: the seed RLVR workflow with an in-process copy3 reward."""
    from transformers import AutoTokenizer

    settings = RolloutSettings(run=RUN, workflow="tests.seed_workflows.rlvr:RLVRWorkflow",
                               workflow_kwargs={"reward_fn": copy3_reward_fn}, group_size=3, max_new_tokens=4,
                               model_path=str(tiny_model))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    workflow = build_workflow(settings, standard_kwargs(settings, lambda: tok, None))
    engine = InferenceEngine(InferenceClientSettings(servers=[url]))
    try:
        async with running_worker(nc, RUN, workflow, engine, nak_delay_s=0.1):
            yield
    finally:
        await engine.aclose()


@pytest.mark.timeout(1200)
async def test_a_trainer_killed_past_its_checkpoint_continues_past_the_version_it_announced(
    nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows(64, chat=True)))
    out = tmp_path / "trainer"
    out.mkdir()
    stack = Stack(nats_url, RUN, tmp_path, tiny_model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    nc = await nats.connect(nats_url)
    await ensure_weight_sync_stream(nc)
    logs = [tmp_path / f"trainer-{i}.log" for i in range(3)]
    with (
        process(stack.server_args(port), tmp_path / "server.log") as server,
        process(stack.agent_args(url, 0), tmp_path / "agent.log"),
    ):
        await wait_healthy(url, server, tmp_path / "server.log")
        async with rollout(nc, tiny_model, url):
            first = start(nats_url, tiny_model, out, dataset, "total_steps=2")
            assert await ended(first, "the first trainer's 2 steps", logs[0]) == 0, _tail(logs[0])

            second = start(nats_url, tiny_model, out, dataset, "total_steps=1000", "--resume", "auto")
            try:
                async def announced_past_checkpoint() -> bool:
                    found = await latest_published(nc, RUN)
                    return found is not None and found.version >= 4

                await until("the second trainer to announce version 4", announced_past_checkpoint, PROCESS_TIMEOUT_S,
                            second)
            finally:
                kill_group(second)  # SIGKILL: its versions past the checkpoint stay announced, unsaved
            killed = await latest_published(nc, RUN)
            assert killed is not None
            n = killed.version

            third = start(nats_url, tiny_model, out, dataset, "total_steps=4", "--resume", "auto")
            code = await ended(third, "the third trainer's steps 3 and 4", logs[2])
            assert code == 0, _tail(logs[2])
            last = await latest_published(nc, RUN)
        status = await trainer_groups(nc, RUN, 5.0)
    rows_ = read_steps(out)
    starts = [i for i, r in enumerate(rows_) if r.get("event") == "start"]
    after = rows_[starts[-1]:]
    js = nc.jetstream()
    heads = [decode_group((await js.get_msg(TRAJECTORIES_STREAM, seq)).data or b"").meta.head_version
             for r in after if "prompt_ids" in r for seq in r["seqs"]]
    await nc.close()

    assert len(starts) == 3
    # the second start was a clean restart (the first trainer checkpointed what it announced): as before
    clean = rows_[starts[1]:starts[2]]
    assert not [r for r in clean if r.get("event") == "versions_continued"], clean
    went_on = [r["version"] for r in clean if "prompt_ids" in r]  # (killed maybe after a publish, before its record)
    assert went_on == list(range(3, 3 + len(went_on))) and went_on, clean
    assert after[0]["resumed"] and after[0]["version"] == 2, after[0]  # restored from the version-2 checkpoint
    trained = [r["version"] for r in after if "prompt_ids" in r]
    assert trained and min(trained) > n + 1, after  # no version the killed trainer announced is announced again
    moved = [r for r in after if r.get("event") == "versions_continued"]
    assert len(moved) == 1 and moved[0]["checkpoint_version"] == 2, after
    # (an announcement the killed trainer had sent may reach the server after the test read `n`)
    n = moved[0]["announced_version"]
    assert moved[0]["version"] == n + 1 and killed.version <= n <= killed.version + 1, after
    # two more steps (the step count goes on from the checkpoint's 2 to total_steps 4), numbered past N+1
    assert trained == [n + 2, n + 3], after
    assert last is not None and last.version == n + 3
    assert status.step == 4, render_groups(status)
    assert "impossible_versions" not in status.terminated, render_groups(status)

    # every group it trained was generated with its own weights (N+1 or newer), none with the killed one's
    assert len(heads) == 4 and min(heads) >= n + 1, heads
    assert "resumed behind the announced weights: checkpoint version 2" in logs[2].read_text(), _tail(logs[2])


def test_a_ledger_resumed_behind_counts_on_and_sets_the_killed_incarnations_prompts_apart() -> None:
    window = VersionWindow(1, version=2)  # the checkpoint's state at version 2
    ledger = PromptLedger(run="r", rows=[{"prompt": f"{i:03d}="} for i in range(10)], batch_groups=2, window=window,
                          max_in_flight=100, seed=3)
    issued = []
    while (task := ledger.next_task(2)) is not None:  # the checkpoint's state at version 2
        ledger.confirm(task.prompt_id)
        issued.append(task.prompt_id)
    bound, failures = ledger.bound(2), [e[2] for e in ledger.in_flight.values()]

    assert window.resume_behind(6) == 4  # announced 5: the restored weights are version 6, the numbering moves by 4
    ledger.resume_behind("t2")
    assert ledger.bound(6) == bound  # the same step, numbered 4 further
    assert not ledger.in_flight and ledger.counters.stale == len(issued)
    again = []
    while (task := ledger.next_task(6)) is not None:
        again.append(task)
    assert [t.prompt_id.rsplit(".", 1)[0] for t in again[:len(issued)]] == [p + "-r1" for p in issued]
    assert all(t.prompt_id.endswith(".t2") for t in again)
    assert all(t.min_version >= 6 for t in again)  # nothing asks for the lost weights
    assert [ledger.in_flight[t.prompt_id][2] for t in again[:len(issued)]] == failures  # uncharged
    restored = PromptLedger(run="r", rows=ledger.rows, batch_groups=2, window=VersionWindow(1), max_in_flight=100)
    restored.load_state_dict(ledger.state_dict())
    restored.window.load_state_dict(6, window.state_dict())  # the trainer restores its window from the checkpoint
    assert (restored.window.first_version, restored.window.own_from, restored.tag) == (4, 6, "t2")


def test_an_intake_resumed_behind_trains_no_group_generated_with_older_weights() -> None:
    window = VersionWindow(1, version=6, first_version=4, own_from=6)
    intake = Intake(window)

    def group(pid: str, version: int) -> tuple[bytes, dict[str, str]]:
        ids = np.tile(np.arange(1, 7, dtype=np.int64), (2, 1))
        mask = np.zeros_like(ids)
        mask[:, 3:] = 1
        tensors = {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": mask,
                   "logprobs": np.where(mask > 0, -1.0, 0.0).astype(np.float32),
                   "rewards": np.array([0.0, 1.0], dtype=np.float32),
                   "versions": np.where(mask > 0, version, -1).astype(np.int64)}
        body, meta = encode_group_with_meta(tensors, run="r", prompt_id=pid, worker="w")
        return body, trajectory_headers(meta)

    old = intake.judge(*group("a", 5), seq=1, version=6)  # the killed trainer's version 5: within eta, but lost
    assert (old.outcome, old.cause) == ("stale", "earlier_run")
    assert intake.judge(*group("b", 6), seq=2, version=6).outcome == "accepted"
    saved = {**intake.state_dict(), **window.state_dict()}  # what the trainer checkpoints as `jetrl_intake`
    again = VersionWindow(1)
    again.load_state_dict(6, saved)
    assert (again.first_version, again.own_from) == (4, 6)
