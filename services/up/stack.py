"""The local stack as OS processes: each service is `python -m services.<name>` configured only by
environment variables (as a container would be), in its own process group, logging to
`<run>/logs/<name>.log`. If one dies the stack stops with its error; `stop()` ends every process group
within a deadline and leaves nothing behind."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from services.common.logging import get_logger
from services.up.child import child_setup
from services.up.fork.client import ForkedProcess, ForkServer

log = get_logger("up")

DRAINED_FIRST = frozenset({"services.rollout"})
"""What `Stack.stop` ends, and waits for, before the rest (by module): a rollout worker's SIGTERM drains
its in-flight episodes, which need the inference servers and the reward service still up (stopped all
at once, each drained episode failed on the reward service already gone, with an error and a traceback
in the worker's log at the end of every run)."""


def settings_class(service: str) -> type[BaseModel]:
    """The settings class of `services.<service>` (its settings module is light to import)."""
    module = importlib.import_module(f"services.{service}.settings")
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, BaseModel) and getattr(obj, "service", None) == service:
            return obj
    raise LookupError(f"services.{service}.settings has no settings class with service = {service!r}")


def to_env(service: str, values: dict[str, Any], cls: type[BaseModel] | None = None, prefix: str = "") -> dict[str, str]:
    """Settings as the environment variables a container would get: nested sections of the settings
    class become `JETRL_<SERVICE>__A__B`; any other value (free-form dicts, lists, bools) is JSON,
    which pydantic-settings parses back into the field's type."""
    cls = cls or settings_class(service)
    env: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key.upper()}"
        field = cls.model_fields.get(key)
        sub = field.annotation if field is not None else None
        if value is None:
            continue  # an unset optional: the service's default (env has no null for `str | None`)
        if isinstance(value, dict) and isinstance(sub, type) and issubclass(sub, BaseModel):
            env.update(to_env(service, value, sub, f"{name}__"))
        elif isinstance(value, (list, dict, bool)):
            env[f"JETRL_{service.upper()}__{name}"] = json.dumps(value)
        else:
            env[f"JETRL_{service.upper()}__{name}"] = str(value)
    return env


@dataclass
class Proc:
    name: str
    module: str
    env: dict[str, str]
    log_path: Path
    required: bool = True
    """A required process ending (even cleanly) before the run is done is a failure."""
    nice: int = 0
    """Its niceness above `jetrl up`'s own (`os.nice`): lower priority for the cores."""
    cpus: tuple[int, ...] = ()
    """The cores it is pinned to (`up.pin_trainer`); empty: any this process may use."""
    popen: subprocess.Popen[bytes] | ForkedProcess | None = field(default=None, repr=False)
    """The process: started by `python -m`, or forked by the fork server (services/up/fork/; its pid comes later)."""

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def poll(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class Stack:
    def __init__(self, run_dir: Path, base_env: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.base_env = base_env
        self.procs: list[Proc] = []
        self.nice: dict[str, int] = {}
        """Niceness by module (`services.<name>`) for the processes started without one of their own."""
        self.cpus: Callable[[str], tuple[int, ...]] = lambda module: ()
        """The cores a module's processes are pinned to (`Layout.cpus`); empty: not pinned."""
        self._reported: set[str] = set()
        self.drained_first: frozenset[str] = DRAINED_FIRST
        """The modules `stop` ends, and waits for, before the others."""
        self.forks: ForkServer | None = None
        """Where services are forked from when their environment allows (fork/client.py); None: `python -m` each."""
        self._procs_file = threading.Lock()

    def fork_from(self, server: ForkServer) -> None:
        self.forks = server
        server.on_started = self._write_procs

    def close_forks(self, timeout_s: float) -> None:
        """Stop the fork server, if any (`stop` does, after the services; this is for a run that ended
        before it could)."""
        if self.forks is not None:
            self.forks.stop(timeout_s)

    def start(self, name: str, module: str, env: dict[str, str], required: bool = True, nice: int | None = None) -> Proc:
        nice = self.nice.get(module, 0) if nice is None else nice
        proc = Proc(name, module, env, self.logs / f"{name}.log", required, nice, self.cpus(module))
        # Only the machine's basics plus this service's settings: exactly what a container gets.
        full_env = {**self.base_env, **env}
        if self.forks is not None and self.forks.accepts(full_env):
            proc.popen = self.forks.spawn(name, module, full_env, proc.log_path, nice, proc.cpus)
        else:
            with open(proc.log_path, "ab") as out:
                proc.popen = subprocess.Popen(
                    [sys.executable, "-m", module],
                    env=full_env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=child_setup(nice, proc.cpus),
                )
        log.info("started", service=name, **({"pid": proc.pid} if proc.pid is not None else {"forked": True}),
                 log=str(proc.log_path), **({"nice": nice} if nice else {}), **({"cpus": list(proc.cpus)} if proc.cpus else {}))
        self.procs.append(proc)
        self._write_procs()
        return proc

    def _write_procs(self) -> None:
        """Which process is which (those with a pid so far), for `jetrl status` and for tests that kill
        one on purpose; rewritten as each forked service's pid comes."""
        with self._procs_file:
            (self.run_dir / "procs.json").write_text(json.dumps({p.name: p.pid for p in self.procs if p.pid is not None}))

    def failed(self) -> Proc | None:
        """The first required process that has ended, if any."""
        for proc in self.procs:
            if proc.required and proc.poll() is not None:
                return proc
        return None

    def all_ended(self, prefix: str) -> Proc | None:
        """The last of a group of replicas, if every one of them has ended."""
        group = [p for p in self.procs if p.name.startswith(prefix)]
        if group and all(p.poll() is not None for p in group):
            return group[-1]
        return None

    def newly_ended(self, prefix: str) -> list[Proc]:
        """Replicas that ended since the last call."""
        ended = [p for p in self.procs if p.name.startswith(prefix) and p.poll() is not None and p.name not in self._reported]
        self._reported.update(p.name for p in ended)
        return ended

    def stop(self, timeout_s: float) -> None:
        """SIGTERM every process group, wait up to the deadline, SIGKILL what is left. The rollout workers
        (`drained_first`) and the trainer first; the others once the rollout workers have ended (at most
        half the deadline), so the episodes a worker drains still have their servers and reward service."""
        deadline = time.monotonic() + timeout_s
        if self.forks is not None:  # nothing more is forked: every process asked for has its pid, or is dropped
            self.forks.close(timeout_s / 2)
        # the trainer serves no episode: it gets its whole deadline to finish its step and checkpoint
        first = [p for p in self.procs if p.module in self.drained_first or p.module == "services.trainer"]
        self._terminate(first)
        self._wait([p for p in first if p.module in self.drained_first], time.monotonic() + timeout_s / 2)
        self._terminate([p for p in self.procs if p not in first])
        self._wait(self.procs, deadline)
        for proc in self.procs:
            # the group too: a launcher's ranks or a pool's workers may outlive their parent
            _signal_group(proc, signal.SIGKILL)
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.wait()
        if self.forks is not None:
            self.forks.stop(timeout_s)

    @staticmethod
    def _terminate(procs: list[Proc]) -> None:
        for proc in reversed(procs):
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)

    @staticmethod
    def _wait(procs: list[Proc], deadline: float) -> None:
        for proc in procs:
            if proc.popen is None:
                continue
            try:
                proc.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("did not stop in time; killing", service=proc.name)


def _signal_group(proc: Proc, sig: signal.Signals) -> None:
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
