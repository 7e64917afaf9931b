"""AReaL's `areal.utils.logging` (`getLogger`), under jetrl's name (docs/compat.md); the logic lives
in `services.rollout.compat.logs`."""

from services.rollout.compat.logs import getLogger

__all__ = ["getLogger"]
