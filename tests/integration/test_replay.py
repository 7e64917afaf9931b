"""`jetrl replay` against a real nats-server: a recorded run's trajectory stream (the bytes and
headers the rollout service publishes) replayed offline with the trainer's own step.

- the same recording, config and seed give bit-identical weights across two replays;
- a replay of the stream and of its Parquet export give the same weights;
- a corrupted message in the recording is skipped with a logged error, counted, and the replay goes on;
- a replay of a range (`jetrl replay --from-seq/--to-seq`, a real process) trains on exactly that range.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from schemas.messages import MetricsEvent, decode
from schemas.subjects import METRICS_STREAM, TRAJECTORIES_STREAM, Subjects
from schemas.trajectory import encode_group
from services.common.bus import connect, declare_streams
from services.replay.export import export_range
from services.replay.service import replay, start_replay
from services.replay.settings import ExportSettings, ReplaySettings
from services.trainer.model.engine import TrainEngine
from tests.support.trainer import make_group, publish_group, publish_rejection, read_steps

LIVE = "live"


async def record(js: Any, model: Path, n: int, *, corrupt_at: int | None = None) -> list[tuple[int, str]]:
    """Publish a recording of `n` copy3 groups of run LIVE (versions advancing as in a live run), a
    rejection marker and an eval group on the side; returns [(seq, prompt_id)] of the training groups."""
    out = []
    for i in range(n):
        if i == corrupt_at:
            # a message whose body got truncated: valid headers, broken Arrow
            ack = await js.publish(Subjects(LIVE).trajectories, b"\xff\xff\xff\xffbroken",
                                   headers={"Jetrl-Prompt-Id": "0-99", "Jetrl-Head-Version": "0", "Jetrl-Tail-Version": "0"},
                                   stream=TRAJECTORIES_STREAM)
            assert ack.seq
        digits = f"{(37 * i) % 1000:03d}"
        pid = f"0-{i}"
        out.append((await publish_group(js, LIVE, pid, make_group(model, digits, version=i // 2, seed=i)), pid))
        if i == 1:
            await publish_rejection(js, LIVE, "0-50")
    return out


def fresh_process_env() -> dict[str, str]:
    """For a `jetrl replay` process: a torch.distributed group of its own, not the one an in-process
    engine of this test session set up (its MASTER_PORT is taken)."""
    dist_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in dist_vars} | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


def replay_settings(tmp: Path, model: Path, nats_url: str, name: str, **kw: Any) -> ReplaySettings:
    return ReplaySettings(run=name, source_run=LIVE, nats_url=nats_url, model_path=str(model), output_dir=str(tmp / name),
                          zero_stage=2, batch_groups=2, seed=3, checkpoint_every=0, fetch_timeout_s=0.2, **kw)


async def run_replay(settings: ReplaySettings, nc: Any) -> tuple[dict[str, torch.Tensor], Any]:
    engine = TrainEngine(settings)
    trainer = await start_replay(settings, engine, nc)
    await replay(trainer, asyncio.Event())
    weights = engine.full_state_dict()
    assert weights is not None
    return weights, trainer


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(180)
async def test_replays_are_bit_identical_from_stream_and_parquet(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await declare_streams(js)
    recorded = await record(js, tiny_model, 6, corrupt_at=3)
    # an eval group: training replays skip it
    await js.publish(Subjects(LIVE).trajectories_eval, encode_group(make_group(tiny_model, "123"), run=LIVE,
                     prompt_id="eval-0", worker="w", is_eval=True), stream=TRAJECTORIES_STREAM)

    with capture_logs() as logs:
        first, trainer = await run_replay(replay_settings(tmp_path, tiny_model, nats_url, "offline-a"), nc)
    # the corrupted message: logged as an error naming its sequence, counted, and the replay went on
    errors = [e for e in logs if e["log_level"] == "error" and "corrupted" in e["event"]]
    assert len(errors) == 1 and errors[0]["stream_seq"] == recorded[3][0] - 1
    assert trainer.source.malformed == 1 and trainer.source.skipped["rejection"] == 1
    steps = [r for r in read_steps(tmp_path / "offline-a") if "prompt_ids" in r]
    assert [pid for r in steps for pid in r["prompt_ids"]] == [pid for _, pid in recorded]
    assert trainer.version == 3
    # the offline run's metrics are under its own name and carry the count
    msub = await js.subscribe(Subjects("offline-a").metrics("trainer"), stream=METRICS_STREAM, ordered_consumer=True)
    events = [decode(MetricsEvent, (await msub.next_msg(timeout=5)).data) for _ in range(3)]
    assert events[-1].values["malformed_messages"] == 1

    second, _ = await run_replay(replay_settings(tmp_path, tiny_model, nats_url, "offline-b"), nc)
    assert same_weights(first, second)

    # the Parquet export of the same recording trains to the same weights
    export = await export_range(js, ExportSettings(run=LIVE, nats_url=nats_url, output=str(tmp_path / "rec.parquet")))
    assert export.groups == 7 and export.malformed == 1 and export.rows == 7 * 4  # + the eval group
    from_parquet, _ = await run_replay(replay_settings(tmp_path, tiny_model, nats_url, "offline-c",
                                                       parquet=[str(export.path)]), nc)
    assert same_weights(first, from_parquet)

    # and training moved the weights at all (otherwise equality would prove nothing)
    initial = TrainEngine(replay_settings(tmp_path, tiny_model, nats_url, "offline-d")).full_state_dict()
    assert initial is not None and not same_weights(first, initial)
    await nc.close()


@pytest.mark.timeout(120)
async def test_jetrl_replay_of_a_seq_range_trains_exactly_that_range(nats_url: str, tiny_model: Path, tmp_path: Path) -> None:
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await declare_streams(js)
    recorded = await record(js, tiny_model, 8)
    await nc.close()
    window = recorded[2:6]
    out = tmp_path / "ranged"
    cmd = [sys.executable, "-m", "services.replay", "run=ranged", "source_run=live", f"nats_url={nats_url}",
           f"model_path={tiny_model}", f"output_dir={out}", "batch_groups=2", "checkpoint_every=0",
           "--from-seq", str(window[0][0]), f"--to-seq={window[-1][0]}", "log_format=json"]
    proc = subprocess.Popen(cmd, env=fresh_process_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output.decode()[-3000:]
    steps = [r for r in read_steps(out) if "prompt_ids" in r]
    assert [pid for r in steps for pid in r["prompt_ids"]] == [pid for _, pid in window]
    assert [s for r in steps for s in r["seqs"]] == [seq for seq, _ in window]
    # it ended with a checkpoint of its own
    assert (out / "checkpoints" / "latest").read_text().strip() == "v00000002"


def test_a_parquet_replay_without_a_nats_server_says_it_needs_one(tiny_model: Path, tmp_path: Path) -> None:
    # Parquet input still publishes metrics on NATS: with no server the error must say so, not just time out.
    from services.common.nats_server import free_port

    out = subprocess.run(
        [sys.executable, "-m", "services.replay", "run=offline", f"parquet=[{tmp_path / 'demo.parquet'}]",
         f"nats_url=nats://127.0.0.1:{free_port()}", "connect_timeout_s=1", f"model_path={tiny_model}",
         f"output_dir={tmp_path / 'out'}", "log_format=json"],
        capture_output=True, text=True, timeout=300, env=fresh_process_env(),
    )
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "needs a NATS server even for Parquet input" in out.stdout + out.stderr
