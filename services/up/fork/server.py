"""`jetrl up`'s fork server: a process that imports once what the services import (pydantic, structlog,
nats-py, aiohttp, httpx; torch and transformers' model classes when the stack has a trainer or a
model-serving inference server), then forks every service from that state. A service started as
`python -m services.<name>` imports all of it again, from nothing: on 2 cores the trainer and the
server each spent ~3 CPU-s on torch and transformers, and every service ~0.5 CPU-s on the light ones,
while the stack started (docs/up.md "Start-up").

A forked service is what `python -m <module>` would have been: its own session (process group), SIGTERM
when its parent dies, its niceness and cores, stdin from /dev/null, stdout and stderr to its log, the
environment it was given (`os.environ` replaced), torch's intra-op threads from its `OMP_NUM_THREADS`,
its module run as `__main__` (`runpy`), and the interpreter's own exit (atexit handlers, exit code).

Only what every service's environment shares may be read at import time, so `jetrl up` forks a service
only when its environment differs from the server's in the services' settings (`JETRL_*`) and
`OMP_NUM_THREADS` alone (client.py `forkable`); nothing that starts threads is imported here (pyarrow
does: each service imports it itself).

Protocol, JSON lines. Requests on stdin: `{"name", "module", "env", "log", "nice", "cpus", "heavy"}`
(`heavy`: fork it only after the heavy imports). Replies on stdout: `{"started": name, "pid": n}`,
`{"exited": pid, "code": n}` (negative: the signal), `{"preloaded": stage, "cpu_s": x, "failed": [...]}`,
and on stdin's end `{"closed": [names of requests dropped unforked]}`; then it reaps its children and exits.

    python -m services.up.fork.server '{"light": [...], "heavy": [...], "model": "<dir>"}'
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import selectors
import sys
import time
from typing import Any

from services.up.child import child_setup


class Server:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.stages: list[tuple[str, list[str]]] = [("light", list(spec.get("light", []))), ("heavy", list(spec.get("heavy", [])))]
        self.model: str = spec.get("model") or ""
        self.heavy_done = False
        self.pending: list[dict[str, Any]] = []
        self.children: dict[int, int] = {}  # pidfd -> pid
        self.closed = False
        self.buffer = b""
        # replies go to a copy of stdout; fd 1 itself goes to stderr, so that a module printing while it
        # imports cannot break the protocol
        self.out = os.dup(1)
        os.dup2(2, 1)
        os.set_blocking(0, False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(0, selectors.EVENT_READ)

    def serve(self) -> dict[str, Any] | None:
        """Preload, then fork what is asked until stdin ends and every child has ended. Returns only in
        a forked child, with its request (the caller becomes that service); None in the server at its end."""
        for stage, modules in self.stages:
            started, failed = time.process_time(), []
            for module in modules:
                if not _preload(module):
                    failed.append(module)
                if (child := self._turn(0.0)) is not None:
                    return child
            if stage == "heavy" and self.model and modules and not _model_classes(self.model):
                failed.append(f"model classes of {self.model}")
            self.heavy_done = stage == "heavy"
            self._say(preloaded=stage, cpu_s=round(time.process_time() - started, 3), failed=failed)
        while not (self.closed and not self.children):
            if (child := self._turn(None)) is not None:
                return child
        return None

    def _turn(self, timeout: float | None) -> dict[str, Any] | None:
        """Read requests and reap children (waiting up to `timeout`; None: until something happens), then
        fork what may be forked now. The request back in a forked child."""
        if any(self._may_fork(r) for r in self.pending):
            timeout = 0.0  # someone is waiting (a heavy service, its imports just done): look, and fork at once
        for key, _ in self.selector.select(timeout):
            if key.fd == 0:
                self._read()
            else:
                self._reap(key.fd)
        for request in [r for r in self.pending if self._may_fork(r)]:
            self.pending.remove(request)
            if (child := self._fork(request)) is not None:
                return child
        return None

    def _may_fork(self, request: dict[str, Any]) -> bool:
        return self.heavy_done or not request.get("heavy")

    def _read(self) -> None:
        try:
            data = os.read(0, 65536)
        except BlockingIOError:
            return
        if not data:  # `jetrl up` closed stdin (or ended): nothing more is forked
            self.selector.unregister(0)
            self.closed = True
            dropped, self.pending = [r["name"] for r in self.pending], []
            self._say(closed=dropped)
            return
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        self.pending += [json.loads(line) for line in lines if line.strip()]

    def _reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self._say(exited=pid, code=os.waitstatus_to_exitcode(status))

    def _fork(self, request: dict[str, Any]) -> dict[str, Any] | None:
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            self.selector.close()
            for fd in (*self.children, self.out):
                os.close(fd)
            return request | {"parent": parent}
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.selector.register(pidfd, selectors.EVENT_READ)
        self._say(started=request["name"], pid=pid)
        return None

    def _say(self, **reply: Any) -> None:
        os.write(self.out, json.dumps(reply).encode() + b"\n")


def _preload(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception as exc:
        print(f"fork server: preloading {module} failed: {exc!r}", file=sys.stderr)
        return False
    return True


def _model_classes(model: str) -> bool:
    """Import the model's own configuration and causal-LM modules (what `from_pretrained` would)."""
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model))]
    except Exception as exc:
        print(f"fork server: the model classes of {model} not preloaded: {exc!r}", file=sys.stderr)
        return False
    return True


def become(request: dict[str, Any]) -> None:
    """In the forked child: turn into the service `request` names, as `python -m <module>` would be, and
    run it (its exit is this process's exit)."""
    child_setup(request["nice"], tuple(request["cpus"]))()
    if os.getppid() != request["parent"]:  # the server died before its death signal was asked for: so does this child
        os._exit(1)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    _title(request["module"])  # before the environment is replaced: setproctitle finds argv's memory by it
    os.environ.clear()
    os.environ.update(request["env"])
    _reset_imported_state(request["env"])
    sys.argv = [request["module"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _reset_imported_state(env: dict[str, str]) -> None:
    """What the preloaded modules took from the server's process that this service must have its own of:
    torch's threads (read from OMP_NUM_THREADS when torch was imported) and numpy's global generator
    (Python's `random` reseeds itself after a fork)."""
    torch = sys.modules.get("torch")
    if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _title(module: str) -> None:
    """`python -m <module>` in `ps` and /proc/<pid>/cmdline, as if started so (setproctitle; the
    environment block is left alone: SPT_NOENV, so /proc/<pid>/environ stays readable)."""
    given = os.environ.get("SPT_NOENV")
    os.environ["SPT_NOENV"] = "1"
    try:
        from setproctitle import setproctitle

        setproctitle(f"{os.path.basename(sys.executable)} -m {module}")
    except ImportError:
        pass
    finally:
        if given is None:
            del os.environ["SPT_NOENV"]
        else:
            os.environ["SPT_NOENV"] = given


def main() -> None:
    child = Server(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}).serve()
    if child is not None:
        become(child)  # the service's own exit (SystemExit) ends this process, not the server's loop


if __name__ == "__main__":
    main()
