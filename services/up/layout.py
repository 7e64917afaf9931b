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
time to 0.9 was no better with one, and two stayed the default. The trainer runs on cores of its own
(`pin_trainer`) where its threads leave cores to the others: on 2 cores its first step came sooner in
12 of 14 alternated pairs (by a median 1.9 s), the seconds a step about the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from services.up.settings import UpSettings

BESIDE_ONE_THREAD = ["reward", "weights"]
"""What runs on the trainer's core by default where the trainer runs one thread (`UpSettings.beside_trainer`)."""


@dataclass(frozen=True)
class Layout:
    cores: int
    rollout_workers: int
    torch_threads: int
    """intra-op threads of the trainer and of each inference server (their OMP_NUM_THREADS)."""
    trainer_cpus: tuple[int, ...] = ()
    """With `pin_trainer`: the cores the trainer runs on alone; empty: no pinning."""
    other_cpus: tuple[int, ...] = ()
    """With `pin_trainer`: the cores every other service runs on."""
    beside_trainer: frozenset[str] = frozenset()
    """The modules (`services.reward`, ...) that run on the trainer's cores (`beside_trainer`)."""

    def cpus(self, module: str) -> tuple[int, ...]:
        """The cores a service's processes are pinned to (empty: not pinned)."""
        return self.trainer_cpus if module == "services.trainer" or module in self.beside_trainer else self.other_cpus


def allowed_cpus() -> list[int]:
    """The cores this process may run on (its affinity mask: a container's cpuset, `taskset`)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(max(1, os.cpu_count() or 1)))


def cores() -> int:
    return max(1, len(allowed_cpus()))


def layout(s: UpSettings, n_cores: int | None = None, cpus: list[int] | None = None) -> Layout:
    """`n_cores` / `cpus`: the machine to lay out (default: this process's affinity)."""
    mask = cpus if cpus is not None else (list(range(n_cores)) if n_cores else allowed_cpus())
    n = len(mask)
    # The trainer and the servers share the cores; each gets an equal share, at least one thread.
    threads = s.torch_threads or max(1, n // (1 + s.inference_servers))
    shape = Layout(cores=n, rollout_workers=s.rollout_workers, torch_threads=threads)
    if s.pin_trainer and threads < n:  # cores left to the others: the trainer's threads get cores of their own
        beside = s.beside_trainer if s.beside_trainer is not None else (BESIDE_ONE_THREAD if threads == 1 else [])
        return replace(shape, trainer_cpus=tuple(mask[:threads]), other_cpus=tuple(mask[threads:]),
                       beside_trainer=frozenset(f"services.{name}" for name in beside))
    return shape


def priorities(s: UpSettings, broadcast: bool) -> dict[str, int]:
    """The niceness (`os.nice` increment) of each service's processes, by module; the trainer's is 0.
    The trainer's step is on the path of every version, so it gets a core first and the servers, the
    rollout workers and the reward service generate in what is left (`serving_nice`); what no step
    waits for runs below them (`background_nice`): the weights agents when the trainer broadcasts (on
    the disk path every version waits for an agent's load) and the experiment tracker."""
    serving = {m: s.serving_nice for m in ("services.inference", "services.rollout", "services.reward")}
    return serving | {"services.weights": s.background_nice if broadcast else s.serving_nice,
                      "services.track": s.background_nice}
