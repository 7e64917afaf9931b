"""AReaL's `areal.utils.stats_tracker`, under jetrl's name (docs/compat.md); the logic lives in
`services.rollout.compat.stats_tracker`."""

from services.rollout.compat.stats_tracker import *  # noqa: F403
