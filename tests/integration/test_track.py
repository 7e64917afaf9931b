"""`jetrl track`: a real trainer process trains on published copy3 groups while a real tracker
process follows the METRICS stream; the reward series read back with TensorBoard's and W&B's own
readers equals the one the trainer published."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from schemas.messages import MetricsEvent, decode
from schemas.subjects import METRICS_STREAM, Subjects
from services.common.bus import connect, declare_streams
from tests.support.trainer import REPO, SERVICE_RUN, make_group, publish_group, start_trainer
from tests.support.waiting import wait_until

STEPS = 4


def tensorboard_series(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def wandb_records(wandb_dir: Path) -> list[dict[str, Any]]:
    """W&B's own reader of an offline run's transaction log: `wandb leet inspect --json`."""
    out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(wandb_dir / "wandb")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def wandb_series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    items = [r["history"]["item"] for r in records if r.get("type") == "history"]
    return [(int(i["trainer_step"]), float(i[key])) for i in items if key in i]


async def trainer_series(url: str) -> list[tuple[int, float]]:
    nc = await connect(url, "test-read")
    js = nc.jetstream()
    last = (await js.stream_info(METRICS_STREAM)).state.last_seq
    sub = await js.subscribe(Subjects(SERVICE_RUN).metrics("trainer"), ordered_consumer=True, stream=METRICS_STREAM)
    series = []
    while True:
        try:
            msg = await sub.next_msg(timeout=2)
        except TimeoutError:
            break
        event = decode(MetricsEvent, msg.data)
        if event.step is not None and "reward_mean" in event.values:
            series.append((event.step, event.values["reward_mean"]))
        if msg.metadata.sequence.stream >= last:
            break
    await nc.close()
    return series


async def test_track_writes_tensorboard_and_wandb_runs_equal_to_the_trainers_series(
    nats_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    nc = await connect(nats_url, "test")
    js = nc.jetstream()
    await declare_streams(js)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"trainer": {"lr": 0.001, "batch_groups": 2}}))
    tb, wb = tmp_path / "tb", tmp_path / "wb"
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}
    tracker = subprocess.Popen(
        [sys.executable, "-m", "services.track", f"run={SERVICE_RUN}", f"nats_url={nats_url}", f"tensorboard.log_dir={tb}",
         "tensorboard.flush_s=1", "wandb.mode=offline", f"wandb.dir={wb}", f"config_path={config}", "log_format=json"],
        cwd=REPO, env=env, stdout=open(tmp_path / "track.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    out = tmp_path / "trainer"
    out.mkdir()
    trainer = start_trainer(nats_url, tiny_model, out, f"total_steps={STEPS}")
    try:
        for i in range(STEPS * 2):
            await publish_group(js, SERVICE_RUN, f"p{i}", make_group(tiny_model, f"{i:03d}", seed=i))
        assert await asyncio.to_thread(trainer.wait, 300) == 0
        published = await trainer_series(nats_url)
        assert [s for s, _ in published] == list(range(1, STEPS + 1))
        wait_until("TensorBoard to hold every trainer step",
                   lambda: len(tensorboard_series(tb, "trainer/reward_mean")) >= STEPS, timeout_s=120, proc=tracker)
        assert tracker.poll() is None, "the tracker ended on its own"
        tracker.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(tracker.wait, 120) == 0
    finally:
        for proc in (tracker, trainer):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        await nc.close()

    def close(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
        return len(a) == len(b) and all(sa == sb and abs(va - vb) < 1e-6 for (sa, va), (sb, vb) in zip(a, b, strict=True))

    assert close(tensorboard_series(tb, "trainer/reward_mean"), published)
    records = wandb_records(wb)
    assert close(wandb_series(records, "trainer/reward_mean"), published)
    # the run's config is logged with the run
    configs = [json.dumps(r) for r in records if r.get("type") in ("run", "config")]
    assert any('"batch_groups": 2' in c for c in configs), configs
