"""`jetrl up`'s side of the fork server (fork/server.py): start it, ask it for a service, and follow each
forked service as `subprocess.Popen` follows a child (`pid`, `poll`, `wait`), from the server's replies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from services.common.logging import get_logger
from services.up.child import die_with_parent

log = get_logger("up")

LIGHT = ("setproctitle", "yaml", "pydantic", "pydantic_settings", "structlog", "msgpack", "orjson", "httpx", "aiohttp",
         "nats", "services.common.settings", "services.common.logging", "services.common.bus", "services.common.runner",
         "services.common.entry")
"""What every service imports (and nothing that starts a thread: pyarrow's allocator does)."""

HEAVY = ("torch", "transformers", "transformers.modeling_utils")
"""What the trainer and a model-serving inference server import, with the model's own classes."""

HEAVY_SERVICES = frozenset({"services.trainer", "services.inference"})
"""Forked only once the heavy imports are done (forked earlier, each would import them itself)."""

MAY_DIFFER = ("JETRL_",)
"""A service's environment may differ from the server's in variables starting so (its settings, read when
it parses them), in OMP_NUM_THREADS (the child applies it to torch itself) and in CUDA_VISIBLE_DEVICES
(read when CUDA starts, which the server never does: it serves `device: cpu` stacks only)."""

READ_LATER = frozenset({"OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"})


def forkable(env: Mapping[str, str], server_env: Mapping[str, str]) -> bool:
    """Whether a service with environment `env` may be forked from a server started with `server_env`: a
    variable read when a preloaded module was imported (PYTHONPATH, HF_*, TORCH_*, OMP_WAIT_POLICY, ...)
    must have the same value; a different one means `python -m` instead."""
    keys = set(env) | set(server_env)
    return all(env.get(k) == server_env.get(k) for k in keys if not k.startswith(MAY_DIFFER) and k not in READ_LATER)


class ForkedProcess:
    """A service the fork server forked (or will fork): what `Stack` asks of a `subprocess.Popen`."""

    def __init__(self, server: ForkServer, name: str, log_path: Path) -> None:
        self._server = server
        self.name = name
        self.log_path = log_path
        self.pid: int | None = None
        """None until the server has forked it (a heavy service waits for the heavy imports)."""
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._server.gone and self.pid is not None and not _alive(self.pid):
            self.returncode = -signal.SIGTERM  # its server died, and it with it (its parent-death signal)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._server.changed:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.name, timeout or 0.0)
                # from the server's replies; once it is gone its children end by their parent-death
                # signal, and nothing replies: the pid is looked at again every 50 ms
                self._server.changed.wait(0.05 if self._server.gone else left)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """`python -m services.up.fork.server`, started with `env` (what every service's environment starts
    from); `heavy`: the modules imported for the trainer and the servers after the light ones (`HEAVY`,
    then `model`'s classes; empty: none, and they are forked at once)."""

    def __init__(self, env: dict[str, str], log_path: Path, *, heavy: tuple[str, ...] = (), model: str = "") -> None:
        self.env = env
        self.log_path = log_path
        self.changed = threading.Condition()
        self.gone = False
        self.closed = False
        self._close_answered = False
        self.on_started: Callable[[], None] = lambda: None
        """Called (from the reader thread) when a service's pid becomes known."""
        self._procs: dict[str, ForkedProcess] = {}
        spec = {"light": list(LIGHT), "heavy": list(heavy), "model": model if heavy else ""}
        with open(log_path, "ab") as err:
            self._popen = subprocess.Popen([sys.executable, "-m", "services.up.fork.server", json.dumps(spec)], env=env,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, preexec_fn=die_with_parent)
        assert self._popen.stdin is not None and self._popen.stdout is not None
        self._stdin: IO[bytes] = self._popen.stdin
        self._reader = threading.Thread(target=self._read, args=(self._popen.stdout,), name="fork-server-replies", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def accepts(self, env: Mapping[str, str]) -> bool:
        """Whether a service with environment `env` is forked here: the server still takes requests, and
        `env` differs from its own only where a fork may (`forkable`)."""
        return not (self.gone or self.closed) and forkable(env, self.env)

    def spawn(self, name: str, module: str, env: dict[str, str], log_path: Path, nice: int, cpus: tuple[int, ...],
              heavy: bool | None = None) -> ForkedProcess:
        """Ask for `python -m <module>` as a fork; returns at once (the pid comes with the server's reply).
        `heavy`: fork it only after the heavy imports (unset: the trainer and the inference servers)."""
        proc = ForkedProcess(self, name, log_path)
        with self.changed:
            if self.gone or self.closed:
                raise RuntimeError(f"the fork server has {'ended' if self.gone else 'been closed'}; {name} cannot be started")
            self._procs[name] = proc
        request = {"name": name, "module": module, "env": env, "log": str(log_path), "nice": nice, "cpus": list(cpus),
                   "heavy": module in HEAVY_SERVICES if heavy is None else heavy}
        self._stdin.write(json.dumps(request).encode() + b"\n")
        self._stdin.flush()
        return proc

    def end_requests(self) -> None:
        """Close the server's requests (its stdin): nothing more is forked."""
        with self.changed:
            if self.closed or self.gone:
                return
            self.closed = True
        with contextlib.suppress(OSError):
            self._stdin.close()

    def close(self, timeout_s: float) -> None:
        """Nothing more is forked: after this every service asked for has a pid or has ended (dropped
        unforked), within `timeout_s` (or the server is killed)."""
        self.end_requests()
        with self.changed:
            if not self.changed.wait_for(lambda: self.gone or self._close_answered, timeout_s):
                log.warning("the fork server did not answer its close in time; killing it", timeout_s=timeout_s)
                self._popen.kill()

    def stop(self, timeout_s: float) -> None:
        """Close, then wait for the server itself (it ends once its children have); kill it after `timeout_s`.
        Again: nothing more."""
        if self._popen.returncode is not None:
            return
        self.close(timeout_s)
        try:
            self._popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait()
        self._reader.join(timeout_s)

    def _read(self, out: IO[bytes]) -> None:
        for line in out:
            try:
                reply = json.loads(line)
            except ValueError:
                log.warning("the fork server wrote what is not a reply", line=line[:200].decode(errors="replace"))
                continue
            with self.changed:
                self._apply(reply)
                self.changed.notify_all()
            if "started" in reply:
                self.on_started()
        with self.changed:
            self.gone = True
            for proc in self._procs.values():
                if proc.pid is None and proc.returncode is None:
                    proc.returncode = 1  # never forked: its server ended first (its log says so)
                    with contextlib.suppress(OSError), open(proc.log_path, "a") as f:
                        f.write(f"jetrl up: the fork server ended before it started {proc.name}: see {self.log_path}\n")
            self.changed.notify_all()

    def _apply(self, reply: dict[str, Any]) -> None:
        if "started" in reply:
            self._procs[reply["started"]].pid = reply["pid"]
        elif "exited" in reply:
            for proc in self._procs.values():
                if proc.pid == reply["exited"]:
                    proc.returncode = reply["code"]
        elif "preloaded" in reply:
            log.info("fork server preloaded", stage=reply["preloaded"], cpu_s=reply["cpu_s"],
                     **({"failed": reply["failed"]} if reply["failed"] else {}))
        elif "closed" in reply:
            self._close_answered = True
            for name in reply["closed"]:
                self._procs[name].returncode = -signal.SIGTERM  # stopped before it was forked


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
