"""How `jetrl up` chooses its trainer's weight transport (services/up/weights.py), and that the trainer
reads what it chose."""

from __future__ import annotations

import pytest

from services.trainer.settings import TrainerSettings
from services.up.stack import to_env
from services.up.weights import in_memory, trainer_weights
from services.weights.sender.settings import BroadcastSync, ColocatedSync, StoreSync

SERVERS = ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]


def test_up_sends_in_memory_to_its_own_servers_unless_they_are_simulated() -> None:
    chosen = trainer_weights({}, SERVERS, simulated=False)
    assert in_memory(chosen) and TrainerSettings(**chosen).weights == ColocatedSync(servers=SERVERS)
    simulated = trainer_weights({}, SERVERS, simulated=True)
    assert not in_memory(simulated) and TrainerSettings(**simulated).weights == StoreSync()


def test_a_trainer_section_chooses_the_transport_and_the_servers_default_to_ups(monkeypatch: pytest.MonkeyPatch) -> None:
    broadcast = trainer_weights({"weights": {"transport": "broadcast", "bucket_mb": 1}}, SERVERS, simulated=False)
    assert TrainerSettings(**broadcast).weights == BroadcastSync(servers=SERVERS, bucket_mb=1)
    store = trainer_weights({"weights": {"transport": "store"}, "lr": 0.1}, SERVERS, simulated=False)
    assert store == {"weights": {"transport": "store"}, "lr": 0.1}  # no servers for a transport that has none
    # what the trainer process gets: the section as environment variables, read back the same
    for key, value in to_env("trainer", broadcast).items():
        monkeypatch.setenv(key, value)
    from services.common.settings import load_settings

    assert load_settings(TrainerSettings).weights == BroadcastSync(servers=SERVERS, bucket_mb=1)


def test_the_old_spelling_in_a_trainer_section_still_switches_the_memory_path_off() -> None:
    with pytest.warns(FutureWarning, match="weights_broadcast: deprecated"):
        chosen = trainer_weights({"weights_broadcast": {"enabled": False}}, SERVERS, simulated=False)
    assert not in_memory(chosen) and "weights_broadcast" not in chosen and TrainerSettings(**chosen).weights == StoreSync()
    with pytest.warns(FutureWarning):  # tuning it without `enabled` kept up's in-memory default
        tuned = trainer_weights({"weights_broadcast": {"bucket_mb": 2}}, SERVERS, simulated=False)
    assert TrainerSettings(**tuned).weights == ColocatedSync(servers=SERVERS, bucket_mb=2)
