"""A minimal service built only from services.common, run as a subprocess by the foundation tests:
it pulls PromptTasks, answers each on a core subject, terminates what does not decode, and optionally
has a task that ignores shutdown (to test the deadline)."""

from __future__ import annotations

import asyncio
import sys

from nats.js.api import AckPolicy, ConsumerConfig

from schemas.messages import MessageError, PromptTask, decode
from schemas.subjects import PROMPTS_STREAM, Subjects
from services.common.bus import Bus
from services.common.entry import service_main
from services.common.metrics import MetricsPublisher
from services.common.poison import terminate_poison
from services.common.runner import Supervisor, supervise
from services.common.settings import ServiceSettings


class EchoSettings(ServiceSettings):
    service = "echo"
    stuck_task: bool = False
    """Start a task that never finishes (the shutdown deadline must cancel it)."""


async def run(settings: EchoSettings, bus: Bus) -> None:
    async def main(sup: Supervisor) -> None:
        nc = await bus.connect("echo", connect_timeout_s=settings.connect_timeout_s)
        sup.stack.push_async_callback(nc.drain)
        js = nc.jetstream()
        await bus.declare_streams(js)
        subjects = Subjects(settings.run)
        metrics = MetricsPublisher(nc, settings.run, "echo")
        sub = await js.pull_subscribe(
            subjects.prompts_all,
            durable=subjects.rollout_consumer,
            stream=PROMPTS_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_deliver=3, ack_wait=5),
        )

        async def loop() -> None:
            while not sup.stopping.is_set():
                try:
                    msgs = await sub.fetch(10, timeout=0.2)
                except TimeoutError:
                    continue
                for msg in msgs:
                    try:
                        task = decode(PromptTask, msg.data)
                    except MessageError as exc:
                        await terminate_poison(msg, exc, metrics)
                        await metrics.emit({})
                        continue
                    await nc.publish(f"echo.{settings.run}.done", task.prompt_id.encode())
                    await msg.ack()
            print("echo: drained", flush=True)

        sup.spawn("pull-loop", loop())
        if settings.stuck_task:
            sup.spawn("stuck", asyncio.Event().wait())
        print("echo: ready", flush=True)

    await supervise("echo", main, settings.shutdown_timeout_s)


if __name__ == "__main__":
    raise SystemExit(service_main(EchoSettings, "tests.integration.echo_service:run", sys.argv[1:]))
