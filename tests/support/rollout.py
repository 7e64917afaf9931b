"""The rollout side as the tests drive it: prompts pushed onto the work queue, trajectories read
back off the TRAJECTORIES stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import nats
from nats.js.api import ConsumerConfig, DeliverPolicy

from schemas.messages import PromptTask, encode
from schemas.subjects import TRAJECTORIES_STREAM, Subjects
from services.rollout.worker import RolloutWorker
from services.rollout.worker_config import WorkerConfig

RUN = "rt"
S = Subjects(RUN)


async def push_prompts(js: Any, n: int, *, subject: str = S.prompts_train, prefix: str = "p") -> list[str]:
    """`n` copy3 prompts of the run `RUN` on `subject`, ids `<prefix><i>`."""
    ids = []
    for i in range(n):
        pid = f"{prefix}{i}"
        task = PromptTask(run=RUN, prompt_id=pid, data={"id": pid, "prompt": f"{i:03d}=", "answer": f"{i:03d}"})
        await js.publish(subject, encode(task), headers={"Nats-Msg-Id": f"{RUN}/prompt/{pid}"})
        ids.append(pid)
    return ids


async def collect(js: Any, subject: str, n: int, timeout_s: float = 20.0) -> list[Any]:
    """Read `n` messages from the TRAJECTORIES stream on `subject` (as the trainer's consumer would),
    then check for a little longer that nothing more arrives."""
    sub = await js.pull_subscribe(
        subject, durable=None, stream=TRAJECTORIES_STREAM, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    )
    got: list[Any] = []
    deadline = asyncio.get_running_loop().time() + timeout_s


    async def fetch(batch: int) -> None:
        with contextlib.suppress(asyncio.TimeoutError, nats.errors.TimeoutError):
            for m in await sub.fetch(batch, timeout=0.3):
                await m.ack()  # at once: an unacked message would come back after ack_wait
                got.append(m)

    while len(got) < n and asyncio.get_running_loop().time() < deadline:
        await fetch(n - len(got))
    await fetch(10)
    await sub.unsubscribe()
    return got


@contextlib.asynccontextmanager
async def running_worker(nc: Any, run: str, workflow: Any, engine: Any, *, stop_timeout_s: float = 30.0,
                         dumper: Any = None, **config: Any) -> AsyncIterator[RolloutWorker]:
    """A rollout worker of `run` running in the test's event loop (declared, pulling) until the block
    ends; `config`: WorkerConfig fields over the tests' defaults (worker "w", 4 at once, short fetches)."""
    cfg = WorkerConfig(**{"worker": "w", "max_concurrent": 4, "fetch_timeout_s": 0.2, **config})
    w = RolloutWorker(nc, run, workflow, engine, cfg, dumper=dumper)
    await w.declare()
    stopping = asyncio.Event()
    task = asyncio.create_task(w.run(stopping))
    try:
        yield w
    finally:
        stopping.set()
        await asyncio.wait_for(task, stop_timeout_s)
