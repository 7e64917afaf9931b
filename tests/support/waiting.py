"""Waiting in tests: poll a condition (a health endpoint, a file, a record) until it holds, failing early
with the process's log when the process being waited on exits. Never a blind sleep."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def wait_until(
    what: str,
    check: Callable[[], bool],
    *,
    timeout_s: float,
    proc: subprocess.Popen[Any] | None = None,
    log: Path | None = None,
    interval_s: float = 0.05,
    ignore: tuple[type[BaseException], ...] = (),
) -> None:
    """`ignore`: errors of `check` that mean "not yet" (e.g. a connection refused while starting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} while waiting for {what}{_tail(log)}")
        try:
            if check():
                return
        except ignore:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}{_tail(log)}")
        time.sleep(interval_s)  # the poll interval of a condition, not a wait for time to pass


def http_ok(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2.0).status_code == 200
    return False


def wait_http_ok(url: str, *, timeout_s: float, proc: subprocess.Popen[Any] | None = None, log: Path | None = None) -> None:
    wait_until(f"{url} to answer 200", lambda: http_ok(url), timeout_s=timeout_s, proc=proc, log=log)


def _tail(log: Path | None, chars: int = 3000) -> str:
    if log is None or not log.exists():
        return ""
    return ":\n" + log.read_text(errors="replace")[-chars:]
