"""`jetrl up`'s stack as data, and the small executor that brings it up.

A plan is a list of typed steps: what to start (a service module and its environment), what it waits
for (`after`: other steps that must be ready first), and how its readiness is known (`ready`: an HTTP
probe; none: started is enough). `execute` starts each step as soon as what it waits for is ready, then
waits until every step is ready, by polling each probe: never a fixed sleep. A required process that
ends while starting, a stop, or the deadline ends it with an error naming the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import httpx

from services.up.stack import Proc, Stack

POLL_S = 0.2
"""How often `execute` asks the probes that have not answered yet."""


@dataclass(frozen=True)
class HttpReady:
    """Ready when `GET <url><path>` answers 200 (an inference server's /health, which runs a test generation)."""

    url: str
    what: str = "inference server"
    """How errors name it."""
    path: str = "/health"


@dataclass(frozen=True)
class Step:
    """One process of the stack."""

    name: str
    """The process's name: its log is `<run>/logs/<name>.log` (`inference-0`, `rollout-1`, ...)."""
    module: str
    """What runs: `python -m <module>`."""
    env: dict[str, str]
    """Its settings, as the environment variables a container would get (`stack.to_env`)."""
    required: bool = True
    """Its end (even a clean one) before the run is done is a failure; False: a replica others replace."""
    after: tuple[str, ...] = ()
    """Steps that must be ready before this one starts (each service waits on the bus itself, so none by default)."""
    ready: HttpReady | None = None
    """How its readiness is known; None: started is ready."""


def check_plan(plan: list[Step]) -> None:
    """Names are unique, and every step waits only for steps listed before it (so no circle)."""
    seen: set[str] = set()
    for step in plan:
        if step.name in seen:
            raise ValueError(f"stack plan: step {step.name!r} appears twice")
        unknown = [d for d in step.after if d not in seen]
        if unknown:
            raise ValueError(f"stack plan: step {step.name!r} waits for {unknown}, which are not listed before it")
        seen.add(step.name)


async def execute(plan: list[Step], stack: Stack, timeout_s: float, stop: asyncio.Event) -> dict[str, Proc]:
    """Start the plan's steps in order, each once its `after` steps are ready, and return when every
    step is ready, with the started processes by name. Raises RuntimeError when a required process ends
    or `stop` is set while starting, TimeoutError when a probe has not answered 200 within `timeout_s`."""
    check_plan(plan)
    deadline = time.monotonic() + timeout_s
    procs: dict[str, Proc] = {}
    ready: set[str] = set()
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            for step in plan:
                if step.name not in procs and all(d in ready for d in step.after):
                    procs[step.name] = stack.start(step.name, step.module, step.env, required=step.required)
                    if step.ready is None:
                        ready.add(step.name)
            failed = stack.failed()
            if failed is not None:
                raise RuntimeError(f"{failed.name} exited with {failed.poll()} while starting:\n{failed.log_tail()}")
            if stop.is_set():
                raise RuntimeError("interrupted while starting")
            for step in plan:  # in order, on to the next as soon as one answers; the first that does not is asked again
                if step.name not in procs or step.name in ready or step.ready is None:
                    continue
                if await _answers(client, step.ready):
                    ready.add(step.name)
                    continue
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{step.ready.what} {step.ready.url} not healthy within {timeout_s}s")
                break
            if len(ready) == len(plan):
                return procs
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)  # the poll interval, cut short by a stop


async def _answers(client: httpx.AsyncClient, probe: HttpReady) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return (await client.get(f"{probe.url}{probe.path}")).status_code == 200
    return False
