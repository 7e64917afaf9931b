"""A reward service running in the test's process for the length of an `async with`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from nats.aio.client import Client as NATS

from services.reward.service import RewardService
from services.reward.settings import RewardSettings


@contextlib.asynccontextmanager
async def running_reward(settings: RewardSettings, nc: NATS) -> AsyncIterator[RewardService]:
    svc = RewardService(settings, nc)
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop(timeout_s=2.0)
