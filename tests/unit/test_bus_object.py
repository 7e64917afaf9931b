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
