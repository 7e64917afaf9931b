"""Helpers for the inference tests: `jetrl inference` as a real process on a free port, ready when
`/health` answers 200 (polled, never slept on), always killed on the way out."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.common.ports import free_port
from tests.support.waiting import wait_http_ok


class ServerProcess:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def spawn_server(model: Path | None, log_dir: Path, *settings: str) -> ServerProcess:
    """Start a server (not yet ready); `wait_ready` afterwards, so several can start in parallel."""
    port = free_port()
    log = log_dir / f"inference-{port}.log"
    args = [f"port={port}", "log_format=json", *settings]
    if model is not None:
        args.insert(0, f"model_path={model}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "services.inference", *args], env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log)


def wait_ready(server: ServerProcess, timeout: float = 90.0) -> ServerProcess:
    try:
        wait_http_ok(server.url + "/health", timeout_s=timeout, proc=server.proc, log=server.log)
    except TimeoutError:
        server.stop(signal.SIGKILL)
        raise
    return server


@contextlib.contextmanager
def running_servers(model: Path | None, log_dir: Path, count: int = 1, *settings: str) -> Iterator[list[ServerProcess]]:
    servers = [spawn_server(model, log_dir, *settings) for _ in range(count)]
    try:
        yield [wait_ready(s) for s in servers]
    finally:
        for s in servers:
            s.stop(signal.SIGKILL, timeout=10)


def reference_logprobs(model_dir: Path | str, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """Logprob of each output token under softmax(logits / T) of a plain full forward pass."""
    import torch

    model = _load(str(model_dir))
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 1e-6 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)
    return logp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1).tolist()


_MODELS: dict[str, Any] = {}


def _load(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    if path not in _MODELS:
        _MODELS[path] = AutoModelForCausalLM.from_pretrained(path).eval()
    return _MODELS[path]
