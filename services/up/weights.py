"""How `jetrl up`'s trainer sends its weights: in memory to the servers `up` started, through shared
memory on this host (`weights.transport: colocated`), unless they are simulated (no model to receive
into: then the WEIGHTS object store). A `trainer.weights` section in the config chooses otherwise; its
`servers` default to the ones `up` started."""

from __future__ import annotations

from typing import Any

from services.common.settings import deep_merge
from services.weights.sender.settings import LEGACY_KEYS, legacy_weights

IN_MEMORY = ("colocated", "broadcast")


def trainer_weights(section: dict[str, Any], servers: list[str], simulated: bool) -> dict[str, Any]:
    """The user's trainer section (`section`) with its `weights` completed for this stack."""
    if any(key in section for key in LEGACY_KEYS):  # the old flat spelling, over up's default as it was spelled then
        old_default = {"weights_broadcast": {"enabled": not simulated, "servers": servers, "transport": "colocated"}}
        return dict(legacy_weights(deep_merge(old_default, section)))
    weights = dict(section.get("weights") or {})
    weights.setdefault("transport", "store" if simulated else "colocated")
    if weights["transport"] in IN_MEMORY:
        weights.setdefault("servers", servers)
    return {**section, "weights": weights}


def in_memory(trainer: dict[str, Any]) -> bool:
    """Whether the trainer sends the weights to the servers itself (the agents only catch up)."""
    return str(trainer.get("weights", {}).get("transport")) in IN_MEMORY
