"""CPU-seconds of every process of a command's tree, by service, sampled while it runs.

`resource.getrusage(RUSAGE_CHILDREN)` only counts children that were waited for, and says nothing of
which service spent what. This samples the tree with psutil (a DeepSpeed dependency, so always
present) every `interval_s` and keeps, per process, the last CPU time seen, grouped under a label:
the service module (`python -m services.trainer` -> "trainer"), "reward pool" for the reward
service's pool processes, or the program's name (`nats-server`). A process that lives less than one
interval is missed; the services of a run live for all of it.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import psutil

FORK_SERVER = "fork server"
"""`jetrl up`'s fork server (services/up/fork/server.py); a child it has just forked carries its command
line until it names itself (setproctitle), so a process with this label is labelled again next sample."""


def label(cmdline: list[str]) -> str:
    # a forked service's title is one string ("python -m services.trainer"), padded with empty arguments
    cmdline = " ".join(cmdline).split() if "-m" not in cmdline else cmdline
    if "-m" in cmdline[:-1]:
        module = cmdline[cmdline.index("-m") + 1]
        if module == "services.up.fork.server":
            return FORK_SERVER
        return module.removeprefix("services.").split(".")[0]
    joined = " ".join(cmdline)
    if "multiprocessing" in joined:
        return "reward pool"
    return (cmdline[0].rsplit("/", 1)[-1] if cmdline else "?") or "?"


class TreeCPU:
    """`with TreeCPU(pid) as tree: ...` then `tree.by_label()` and `tree.by_label(until_s=...)`."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.started = time.time()
        self._last: dict[int, tuple[str, float]] = {}
        self._rss: dict[int, tuple[str, int]] = {}
        self._series: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeCPU:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def _sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    rss = proc.memory_info().rss
                    known = self._last.get(proc.pid, (FORK_SERVER, 0.0))[0]
                    name = label(proc.cmdline()) if known == FORK_SERVER else known
            except psutil.Error:
                continue
            self._last[proc.pid] = (name, times.user + times.system)
            self._rss[proc.pid] = (name, max(rss, self._rss.get(proc.pid, (name, 0))[1]))
        self._series.append((time.time() - self.started, dict(self._last)))

    def by_label(self, until_s: float | None = None) -> dict[str, float]:
        """CPU-seconds per label over the whole run, or up to `until_s` after the start."""
        last = self._last
        if until_s is not None:
            before = [snap for t, snap in self._series if t <= until_s]
            last = before[-1] if before else {}
        out: dict[str, float] = defaultdict(float)
        for name, cpu in last.values():
            out[name] += cpu
        return dict(out)

    def peak_rss_by_label(self) -> dict[str, float]:
        """GiB: the largest sampled resident size of one process of each label (a label's processes are
        not added up: the trainer's peak, not the sum of the reward pool's)."""
        out: dict[str, float] = defaultdict(float)
        for name, rss in self._rss.values():
            out[name] = max(out[name], rss / 2**30)
        return dict(out)
