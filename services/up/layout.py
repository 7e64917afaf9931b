"""How `jetrl up` spreads its processes over this machine's cores: how many rollout worker processes,
and how many torch intra-op threads the trainer and each inference server get. Unset settings are
derived from the core count; a setting (or a `--config` section) always wins.

Why these rules (docs/up.md "Processes and threads"): a rollout worker is an asyncio client that
drives `max_concurrent` episodes at once and spends its CPU on HTTP and JSON, never on tensors, so
on a small machine a second one only adds its start (imports, the tokenizer: ~3.5 CPU-s) and its
scheduling to the cores the server and the trainer need. The trainer and the inference servers do the
tensor work; the other processes (reward, weights agents, rollout workers, nats-server) stay at one
thread each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.up.settings import UpSettings

CORES_PER_ROLLOUT_WORKER = 4
"""A rollout worker process per this many cores (at least one): one drives its episodes concurrently
and is far from a core's worth of work at the demo's rates."""
MAX_DERIVED_ROLLOUT_WORKERS = 2
"""More than two is a choice for a real cluster (`rollout_workers`), not a default."""


@dataclass(frozen=True)
class Layout:
    cores: int
    rollout_workers: int
    torch_threads: int
    """intra-op threads of the trainer and of each inference server (their OMP_NUM_THREADS)."""


def cores() -> int:
    """The cores this process may run on (its affinity mask: a container's cpuset, `taskset`)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def layout(s: UpSettings, n_cores: int | None = None) -> Layout:
    n = n_cores or cores()
    workers = s.rollout_workers or max(1, min(MAX_DERIVED_ROLLOUT_WORKERS, n // CORES_PER_ROLLOUT_WORKER))
    # The trainer and the servers share the cores; each gets an equal share, at least one thread.
    threads = s.torch_threads or max(1, n // (1 + s.inference_servers))
    return Layout(cores=n, rollout_workers=workers, torch_threads=threads)
