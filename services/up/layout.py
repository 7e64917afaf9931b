"""How `jetrl up` spreads its processes over this machine's cores: how many torch intra-op threads the
trainer and each inference server get (derived from the core count unless set), and how many rollout
worker processes run (`rollout_workers`). A setting (or a `--config` section) always wins.

Why (docs/up.md "Processes and threads", measured on 2 cores): the trainer and the inference servers
do the tensor work and share the cores, so each gets an equal share; a second OpenMP thread per
process on 2 cores made a step 6-10 times slower. One rollout worker is the default: measured on 2
cores (three alternating runs each, load 5-10), one worker with `max_concurrent` 64 against two with
32 reached the 10-step mean reward of 0.9 sooner in every pair (38, 60, 62 s against 44, 86, 78 s),
with 0.17 against 0.23-0.26 rollout CPU-s per 1000 samples and ~1.2 CPU-s less start-up (one
process fewer). Earlier, with workers that imported torch to start and noisier runs (load 6-14),
time to 0.9 was no better with one, and two stayed the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.up.settings import UpSettings


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
    # The trainer and the servers share the cores; each gets an equal share, at least one thread.
    threads = s.torch_threads or max(1, n // (1 + s.inference_servers))
    return Layout(cores=n, rollout_workers=s.rollout_workers, torch_threads=threads)


def priorities(s: UpSettings, broadcast: bool) -> dict[str, int]:
    """The niceness (`os.nice` increment) of each service's processes, by module; the trainer's is 0.
    The trainer's step is on the path of every version, so it gets a core first and the servers, the
    rollout workers and the reward service generate in what is left (`serving_nice`); what no step
    waits for runs below them (`background_nice`): the weights agents when the trainer broadcasts (on
    the disk path every version waits for an agent's load) and the experiment tracker."""
    serving = {m: s.serving_nice for m in ("services.inference", "services.rollout", "services.reward")}
    return serving | {"services.weights": s.background_nice if broadcast else s.serving_nice,
                      "services.track": s.background_nice}
