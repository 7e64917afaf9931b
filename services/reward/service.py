"""The reward service: a NATS micro-service (discovery, ping, stats) whose endpoint on
`jetrl.reward.score`, in a queue group, scores batches of items in a process pool.

Each request runs as its own task (nats-py hands a subscription's messages to its callback one at a
time, so awaiting the pool in the callback would serialize requests); `max_concurrent_requests`
bounds them, and past it requests wait in the subscription.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NATS
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Request
from nats.micro.service import EndpointStats, Service, ServiceConfig

from schemas.messages import MessageError, RewardItem, RewardReply, RewardRequest, RewardResult, decode, encode
from schemas.subjects import REWARD_QUEUE_GROUP, REWARD_SUBJECT
from services.common.health import register_check
from services.common.logging import get_logger
from services.common.metrics import MetricsPublisher
from services.reward.allowlist import NotAllowedError
from services.reward.pool import ScoringPool
from services.reward.settings import RewardSettings
from services.reward.stats import RewardStats

if TYPE_CHECKING:
    from services.common.bus import Bus

log = get_logger("reward")

SERVICE_NAME = "jetrl-reward"
SERVICE_VERSION = "0.1.0"
HDR_INSTANCE = "Jetrl-Reward-Instance"


class RequestRefused(ValueError):
    """A request the service will not score; the message goes back to the caller as `reply.error`."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "malformed" | "refused"


def item_kwargs(item: RewardItem) -> dict[str, Any]:
    """The call's keyword arguments: the row's fields, then the item's own (which win on a clash, so
    a row that has a `prompt` column still gets the prompt that was actually sent)."""
    return {
        **item.data,
        "prompt": item.prompt,
        "completion": item.completion,
        "prompt_ids": item.prompt_ids,
        "completion_ids": item.completion_ids,
    }


class RewardService:
    """Start it in any event loop (tests do); `run` below is the `jetrl reward` process around it."""

    def __init__(self, settings: RewardSettings, nc: NATS) -> None:
        self.settings = settings
        self.nc = nc
        self.instance = settings.instance_name
        self.allow = settings.allow_list
        self.pool = ScoringPool(
            settings.pool_processes,
            start_method=settings.start_method,
            preload=sorted(set(self.allow.preload_modules()) | set(settings.preload)),
            max_tasks=settings.max_tasks_per_process,
            max_extra=settings.max_extra_processes,
            slow_item_s=settings.slow_item_s,
        )
        self.stats = RewardStats()
        self.metrics = MetricsPublisher(nc, settings.run, "reward", worker=self.instance)
        self._micro: Service | None = None
        self._slots = asyncio.Semaphore(settings.max_concurrent_requests)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loadable: set[str] = set()
        self._stopped = False

    def _ready(self) -> bool | None:
        """Readiness for the side port's /readyz: not until the pool is warm and the endpoint is up;
        None (check removed) once stopped."""
        return None if self._stopped else self._micro is not None

    async def start(self) -> None:
        t0 = time.monotonic()
        register_check(f"reward:{self.instance}", self._ready)
        await self.pool.start()
        micro = Service(
            self.nc,
            ServiceConfig(
                name=SERVICE_NAME,
                version=SERVICE_VERSION,
                description="jetrl reward functions scored in a process pool",
                queue_group=REWARD_QUEUE_GROUP,
                metadata={"instance": self.instance, "processes": str(self.pool.processes)},
                stats_handler=self._stats_data,
            ),
        )
        # The endpoint subscribes before the discovery verbs, so a replica that answers PING is
        # already taking requests.
        await micro.add_endpoint(name="score", subject=REWARD_SUBJECT, queue_group=REWARD_QUEUE_GROUP, handler=self._on_request)
        await micro.start()
        self._micro = micro
        log.info(
            "reward service ready",
            instance=self.instance,
            processes=self.pool.processes,
            allowed=self.allow.describe(),
            start_s=round(time.monotonic() - t0, 3),
            cpus=sorted(os.sched_getaffinity(0)),  # the cores it (and its pool) runs on: `jetrl up` may pin them
        )

    async def stop(self, timeout_s: float | None = None) -> None:
        """Stop taking requests, let those in flight finish within the deadline, close the pool."""
        timeout_s = self.settings.shutdown_timeout_s / 3 if timeout_s is None else timeout_s
        self._stopped = True
        if self._micro is not None:
            await self._micro.stop()
            self._micro = None
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for task in late:
                task.cancel()
            if late:
                log.warning("requests still running at the shutdown deadline were cancelled", count=len(late))
                await asyncio.wait(late, timeout=2.0)
        await self.pool.close()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def metrics_values(self) -> dict[str, float]:
        return self.stats.snapshot(self.pool.restarts, self.pool.extra_started, self.pool.size, self.in_flight)

    async def metrics_loop(self, stopping: asyncio.Event) -> None:
        interval = self.settings.metrics_interval_s
        while True:
            try:
                await asyncio.wait_for(stopping.wait(), timeout=interval)
            except TimeoutError:
                await self.metrics.emit(self.metrics_values())
                continue
            await self.metrics.emit(self.metrics_values())
            return

    def _stats_data(self, _: EndpointStats) -> dict[str, Any]:
        return {
            **dict(self.stats.totals),
            "pool_restarts": self.pool.restarts,
            "pool_extra_started": self.pool.extra_started,
            "pool_processes": self.pool.size,
            "in_flight": self.in_flight,
        }

    async def _on_request(self, req: Request) -> None:
        await self._slots.acquire()  # back-pressure: the next message waits in the subscription
        task = asyncio.create_task(self._serve(req), name="reward-request")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, req: Request) -> None:
        t0 = time.monotonic()
        try:
            results = await self.score_bytes(req.data)
        except RequestRefused as exc:
            self.stats.refused(exc.kind)
            if exc.kind == "malformed":
                self.metrics.count("malformed_messages")
            log.warning("reward request refused", kind=exc.kind, error=str(exc), subject=req.subject)
            await self._respond(req, RewardReply(error=str(exc)), code="400", error=str(exc))
        except Exception as exc:  # a bug of ours: tell the caller now rather than let it time out
            log.error("reward request failed", error=repr(exc), exc_info=exc)
            await self._respond(req, RewardReply(error=f"reward service error: {exc!r}"), code="500", error=repr(exc))
        else:
            self.stats.request_done(results, time.monotonic() - t0)
            await self._respond(req, RewardReply(results=results))
        finally:
            self._slots.release()

    async def score_bytes(self, data: bytes) -> list[RewardResult]:
        """Decode, check and score one request; `RequestRefused` says why a request is not scored."""
        try:
            request = decode(RewardRequest, data)
        except MessageError as exc:
            raise RequestRefused("malformed", f"malformed reward request: {exc}") from exc
        return await self.score(request)

    async def score(self, request: RewardRequest) -> list[RewardResult]:
        try:
            self.allow.check(request.fn)
        except NotAllowedError as exc:
            raise RequestRefused("refused", str(exc)) from exc
        if len(request.items) > self.settings.max_items:
            raise RequestRefused(
                "refused", f"{len(request.items)} items in one request; this service takes at most {self.settings.max_items}"
            )
        timeout_s = self.settings.item_timeout_s if request.timeout_s is None else request.timeout_s
        if not 0 < timeout_s <= self.settings.max_item_timeout_s:
            raise RequestRefused(
                "refused", f"timeout_s {timeout_s} must be > 0 and <= {self.settings.max_item_timeout_s} (max_item_timeout_s)"
            )
        if request.fn not in self._loadable:
            problem = await self.pool.check(request.fn)
            if problem:
                raise RequestRefused("refused", f"reward function {request.fn}: {problem}")
            self._loadable.add(request.fn)
        return await self.pool.score_many(request.fn, [item_kwargs(i) for i in request.items], timeout_s)

    async def _respond(self, req: Request, reply: RewardReply, code: str = "", error: str = "") -> None:
        headers = {HDR_INSTANCE: self.instance}
        if code:
            headers |= {ERROR_CODE_HEADER: code, ERROR_HEADER: error[:512].replace("\n", " ")}
        try:
            await req.respond(encode(reply), headers=headers)
        except Exception as exc:  # the caller is gone or NATS is down: nothing left to tell anyone
            log.warning("could not send the reward reply", error=repr(exc))


async def run(settings: RewardSettings, bus: Bus) -> None:
    """`jetrl reward`: connect, warm the pool, serve until SIGTERM, drain, exit."""
    from services.common.bus import close_connection
    from services.common.runner import Supervisor, supervise

    async def main(sup: Supervisor) -> None:
        nc = await bus.connect(f"reward-{settings.instance_name}", connect_timeout_s=settings.connect_timeout_s)
        sup.stack.push_async_callback(close_connection, nc)
        try:
            await bus.declare_streams(nc.jetstream())  # so metrics land in METRICS even if we start first
        except Exception as exc:  # scoring needs only core NATS; metrics are then not recorded
            log.warning("could not declare the streams; metrics will not be recorded", error=repr(exc))
        service = RewardService(settings, nc)
        sup.stack.push_async_callback(service.stop)  # runs before nc.drain (last in, first out)
        await service.start()
        sup.spawn("metrics", service.metrics_loop(sup.stopping))

    await supervise("reward", main, settings.shutdown_timeout_s, retry=bus.retry)
