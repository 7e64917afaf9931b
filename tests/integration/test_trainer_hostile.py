"""Hostile trajectory groups among good ones, sent to `python -m services.trainer` over a real
nats-server: out-of-vocabulary token ids, an 8 x 60k-token group, metadata claiming 500,000 tokens in
a few KB, a NaN reward. Each is terminated (JetStream's MSG_TERMINATED advisory names it), logged with
its worker and prompt id, counted by cause in the trainer's metrics and `jetrl status`; the good
groups are trained and the trainer finishes its steps."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from schemas.headers import trajectory_headers
from schemas.subjects import TRAJECTORIES_STREAM, Subjects
from schemas.trajectory import TrajectoryMeta, encode_group, encode_table, group_to_table
from services.common.bus import connect, declare_streams
from services.status.groups import render_groups, trainer_groups
from tests.support.trainer import SERVICE_RUN as RUN
from tests.support.trainer import kill_group, make_group, publish_group, read_steps, start_trainer

BAD = "bad0"


def _oov(model: Path) -> bytes:
    g = make_group(model, "111", seed=11)
    g["input_ids"][1, 3] = 100_000  # the tiny model's vocabulary has a few dozen tokens
    return encode_group(g, run=RUN, prompt_id=BAD, worker="w-hostile")


def _oversize(model: Path) -> bytes:
    n, length = 8, 60_000
    ids = np.full((n, length), 5, dtype=np.int64)
    loss_mask = np.ones_like(ids)
    loss_mask[:, :4] = 0
    g = {"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": loss_mask,
         "logprobs": np.where(loss_mask > 0, -1.0, 0.0).astype(np.float32), "rewards": np.arange(n, dtype=np.float32),
         "versions": np.where(loss_mask > 0, 0, -1).astype(np.int64)}
    return encode_group(g, run=RUN, prompt_id=BAD, worker="w-hostile")


def _lying(model: Path) -> bytes:
    table, _ = group_to_table(make_group(model, "222", seed=22, group_size=8), run=RUN, prompt_id=BAD, worker="w-hostile")
    metadata = dict(table.schema.metadata or {})
    metadata[b"jetrl.seqlen"] = b"500000"
    return encode_table(table.replace_schema_metadata(metadata))


def _nan(model: Path) -> bytes:
    g = make_group(model, "333", seed=33)
    g["rewards"][2] = np.nan
    return encode_group(g, run=RUN, prompt_id=BAD, worker="w-hostile")


def _huge_reward(model: Path) -> bytes:
    g = make_group(model, "444", seed=44)
    g["rewards"][1] = 3e38  # finite: passes the NaN check, but one such group would make the step's reward mean 1e36
    return encode_group(g, run=RUN, prompt_id=BAD, worker="w-hostile")


def _huge_logprob(model: Path) -> bytes:
    g = make_group(model, "555", seed=55)
    g["logprobs"][0][np.flatnonzero(g["loss_mask"][0])[0]] = -3e38
    return encode_group(g, run=RUN, prompt_id=BAD, worker="w-hostile")


KINDS: dict[str, tuple[Callable[[Path], bytes], str]] = {
    "oov": (_oov, "oov_token"),
    "oversize": (_oversize, "too_long"),
    "lying_metadata": (_lying, "length_mismatch"),
    "nan_reward": (_nan, "non_finite"),
    "huge_reward": (_huge_reward, "out_of_bounds"),
    "huge_logprob": (_huge_logprob, "out_of_bounds"),
}


async def _publish_raw(js: Any, data: bytes) -> int:
    headers = trajectory_headers(TrajectoryMeta(run=RUN, prompt_id=BAD, worker="w-hostile", head_version=0, tail_version=0))
    ack = await js.publish(Subjects(RUN).trajectories, data, headers=headers, stream=TRAJECTORIES_STREAM)
    return int(ack.seq)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_hostile_group_is_terminated_and_counted_while_training_goes_on(
    kind: str, nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    make, cause = KINDS[kind]
    out = tmp_path / "trainer"
    out.mkdir()
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await declare_streams(js)
    terminated: list[int] = []

    async def on_terminated(msg: Any) -> None:
        terminated.append(int(json.loads(msg.data)["stream_seq"]))

    S = Subjects(RUN)
    await nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{TRAJECTORIES_STREAM}.{S.trainer_consumer}", cb=on_terminated)
    good = [f"p{i}" for i in range(4)]
    await publish_group(js, RUN, good[0], make_group(tiny_model, "000", seed=0))
    bad_seq = await _publish_raw(js, make(tiny_model))
    for i, pid in enumerate(good[1:], 1):
        await publish_group(js, RUN, pid, make_group(tiny_model, f"{i:03d}", seed=i))

    proc = start_trainer(nats_url, tiny_model, out, "total_steps=2", "checkpoint_every=0")
    try:
        assert await asyncio.to_thread(proc.wait, 180) == 0, "the trainer finishes its steps"
    finally:
        kill_group(proc)

    trained = Counter(pid for r in read_steps(out) if "prompt_ids" in r for pid in r["prompt_ids"])
    assert trained == Counter(good), "the good groups are trained once each, the bad one never"
    await nc.flush()
    assert terminated == [bad_seq], "the bad group's message is terminated (never redelivered)"
    groups = await trainer_groups(nc, RUN, 5.0)
    await nc.close()
    assert groups.terminated == {cause: 1} and groups.outcomes["malformed"] == 1
    assert f"terminated: 1 ({cause} 1)" in render_groups(groups)
    logged = [json.loads(line) for line in (tmp_path / "trainer-0.log").read_text().splitlines() if line.startswith("{")]
    lines = [r for r in logged if r.get("event") == "invalid group terminated"]
    assert [(r["cause"], r["prompt_id"], r["worker"]) for r in lines] == [(cause, BAD, "w-hostile")]
