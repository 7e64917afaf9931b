"""AReaL's `areal.utils.perf_tracer`, under jetrl's name (docs/compat.md); the logic lives in
`services.rollout.compat.perf_tracer`."""

from services.rollout.compat.perf_tracer import *  # noqa: F403
