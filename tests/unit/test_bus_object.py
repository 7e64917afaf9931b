"""The `Bus` a service's entry point makes from its settings (services/common/bus.py)."""

from __future__ import annotations

import pytest

from services.common.bus import DECLARE_BUDGET_S, Bus
from services.common.nats_auth import NatsAuth
from services.reward.settings import RewardSettings
from services.trainer.settings import TrainerSettings


def test_a_services_bus_is_what_its_settings_say() -> None:
    auth = NatsAuth(user="trainer", password="pw")
    bus = Bus.of(TrainerSettings(nats_url="nats://a:1,nats://b:2", nats_auth=auth, nats_replicas=3, bus_declare=False,
                                 bus_retry_timeout_s=42.0))
    assert bus == Bus("nats://a:1,nats://b:2", auth, 3, False, 42.0)
    # a service without a retry budget of its own rides out an unanswering bus as long as declaring does
    assert Bus.of(RewardSettings()).retry_budget_s == DECLARE_BUDGET_S


def test_another_user_on_the_same_bus_keeps_its_replicas_and_says_whether_it_declares() -> None:
    bus = Bus("nats://x:1", NatsAuth(user="admin", password="a"), replicas=3)
    observer = bus.as_user(NatsAuth(user="observer", password="o"), declare=False)
    assert (observer.auth.user if observer.auth else None, observer.replicas, observer.declare) == ("observer", 3, False)
    assert bus.as_user(None) == bus  # no credentials given: its own
    with pytest.raises(ValueError, match="nats_replicas must be at least 1, got 0"):
        Bus(replicas=0)


def test_a_stop_ends_the_retries_of_its_own_service_only() -> None:
    """Each service's retries live in its own Bus (no process-wide state): its supervisor's stop gives
    up a call failing through an outage at once, while another bus's call still waits the outage out;
    the store alarm asks the monitor address the settings name."""
    import asyncio

    import nats.errors

    from services.common.busretry import BusUnavailable
    from services.common.runner import Supervisor, supervise

    stopping, other = Bus(), Bus()
    assert Bus.of(TrainerSettings(nats_monitor_url="http://127.0.0.1:8222")).retry.alarm.monitor_url == "http://127.0.0.1:8222"
    calls = {"stopping": 0, "other": 0}
    retrying = asyncio.Event()

    async def down(name: str) -> None:
        calls[name] += 1
        if name == "stopping" and calls[name] >= 2:  # retrying through the outage
            retrying.set()
        raise nats.errors.NoServersError()

    async def scenario() -> tuple[BaseException | None, bool]:
        outcome: list[BaseException | None] = []

        async def main(sup: Supervisor) -> None:
            async def call() -> None:
                try:
                    await stopping.retries("publish", lambda: down("stopping"))
                except BusUnavailable as exc:
                    outcome.append(exc)

            sup.spawn("call", call())
            await retrying.wait()
            sup.stop()

        waiting = asyncio.create_task(other.retries("publish", lambda: down("other")))
        await supervise("test", main, shutdown_timeout_s=5.0, handle_signals=False, retry=stopping.retry)
        still = not waiting.done()
        waiting.cancel()
        return outcome[0], still

    gave_up, other_waits = asyncio.run(scenario())
    assert isinstance(gave_up, BusUnavailable) and "stopping while NATS is unavailable" in str(gave_up)
    assert other_waits
    assert stopping.retry.stopping is None  # unbound when its supervisor ends
