"""A full JetStream store: how nats-server says it, and how jetrl recognises it.

What nats-server (2.15) does when the filesystem of its file store is full, measured on a 48 MB
tmpfs (tests/e2e/test_up_store_full.py, docs/security.md "A full disk"):
- the write fails with ENOSPC; the server logs `Filestore [<stream>] Critical write error: write
  .../streams/<stream>/msgs/<n>.blk: no space left on device` and answers the publish with
  err_code 10051 ("... no space left on device"), or not at all (a plain stream's publisher then
  sees its ack time out, as in an outage);
- the stream keeps failing that same block after space returns, until nats-server restarts;
- `/healthz?details=true` on its monitor port answers 503 and lists each such stream with its write
  error: `store_errors` reads it (`jetrl up` every second, `jetrl status` once).
At its own `max_file_store` JetStream refuses a write cleanly instead, with a 503 and err_code 10023
("insufficient resources"; measured), and writes again as soon as space is made inside the store (a
purge, older messages discarded); 10047 ("insufficient storage resources available") is its word for
the same at an account's limits.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from collections import Counter

import nats.js.errors

from services.common.logging import get_logger

log = get_logger("bus.store")

INSUFFICIENT_RESOURCES = (10023, 10047)
"""JetStream's "insufficient resources" (the server's `max_file_store` reached) and "insufficient storage
resources available" (an account's limit)."""
STORE_FAILED = 10051
"""JetStream's "stream store failed": the write itself failed (with "no space left on device" when the disk is full)."""
_FULL_WORDS = ("no space left on device", "insufficient storage", "insufficient resources")
_STREAM_IN_PATH = re.compile(r"/streams/([^/\s]+)/")
_STREAM_IN_TEXT = re.compile(r"stream '[^']*> ([^']+)'")
ASK_EVERY_S = 3.0
"""After a timed-out write, the server's health is asked at most this often per process."""
LOG_EVERY_S = 30.0
"""A stream's store-full error is logged again at most this often per process (it is counted each time)."""


def stream_named_in(text: str) -> str:
    """The stream an error text of nats-server names (its block file's path, or `'<account> > <stream>'`), else ""."""
    found = _STREAM_IN_PATH.search(text) or _STREAM_IN_TEXT.search(text)
    return found.group(1) if found else ""


def store_full(exc: BaseException) -> str | None:
    """When `exc` is JetStream refusing a write for want of space: the stream it names ("" when it
    names none); else None. A timeout is never taken for one (it looks like an outage)."""
    if not isinstance(exc, nats.js.errors.APIError):
        return None
    text = f"{exc.description or ''} {exc}".lower()
    if exc.err_code in INSUFFICIENT_RESOURCES or (exc.err_code == STORE_FAILED and any(w in text for w in _FULL_WORDS)):
        return exc.stream or stream_named_in(exc.description or "")
    return None


def store_errors(monitor_url: str, timeout_s: float = 2.0) -> dict[str, str]:
    """{stream: nats-server's write error} for each stream whose store cannot be written, from the
    server's `/healthz?details=true` (empty: all healthy). Raises `OSError` when the monitor port does
    not answer (a server stopped or restarting)."""
    try:
        with urllib.request.urlopen(f"{monitor_url.rstrip('/')}/healthz?details=true", timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:  # 503: unhealthy, with the details
        body = exc.read()
    try:
        report = json.loads(body or b"{}")
    except ValueError:
        return {}
    out: dict[str, str] = {}
    for err in report.get("errors") or []:
        text = str(err.get("error", ""))
        if "write error" in text or any(w in text.lower() for w in _FULL_WORDS):
            out[str(err.get("stream") or stream_named_in(text))] = text
    return out


def describe(errors: dict[str, str]) -> str:
    """One line for a person: `STORE FULL: TRAJECTORIES, METRICS (no space left on device)`."""
    causes = sorted({"no space left on device" if "no space left" in e else e.rsplit(": ", 1)[-1] for e in errors.values()})
    return f"STORE FULL: {', '.join(sorted(errors))} ({'; '.join(causes)})"


class StoreAlarm:
    """A service's view of the store after its writes time out (its `Bus`'s retry policy holds it):
    with the server's monitor address (`nats_monitor_url`, which `jetrl up` sets), a timed-out write asks the server's health (at
    most every `ASK_EVERY_S`) whether streams cannot be written; each is then logged at error level,
    naming it (at most every `LOG_EVERY_S`), and counted in `seen`."""

    def __init__(self, monitor_url: str = "") -> None:
        self.monitor_url = monitor_url
        self.seen: Counter[str] = Counter()
        """How often a timed-out write of this process met each stream unwritable."""
        self._asked = -ASK_EVERY_S
        self._errors: dict[str, str] = {}
        self._logged: dict[str, float] = {}

    async def after_timeout(self, what: str) -> dict[str, str]:
        """{stream: write error} the server reports now (cached for `ASK_EVERY_S`); {} without a monitor address."""
        if not self.monitor_url:
            return {}
        if time.monotonic() - self._asked >= ASK_EVERY_S:  # one question at a time: others meanwhile take the last answer
            self._asked = time.monotonic()
            try:
                self._errors = await asyncio.to_thread(store_errors, self.monitor_url, 2.0)
            except OSError:  # the server itself is away: an outage, said by the retries
                self._errors = {}
        now = time.monotonic()
        for stream, error in self._errors.items():
            self.seen[stream] += 1
            if now - self._logged.get(stream, -LOG_EVERY_S) >= LOG_EVERY_S:
                self._logged[stream] = now
                log.error("the JetStream store is full: a write timed out and nats-server cannot write the stream; "
                          "retried until space returns (docs/security.md \"A full disk\")", stream=stream, what=what, error=error)
        return dict(self._errors)

    async def write_failed(self, exc: BaseException, stream: str, what: str) -> bool:
        """Whether a failed write to `stream` met a full store: a refusal for space (logged here,
        naming the stream), or a timeout while the server's health names `stream` (logged by
        `after_timeout`)."""
        refused = store_full(exc)
        if refused is not None:
            log.error("the JetStream store is full: a write was refused (docs/security.md \"A full disk\")",
                      stream=refused or stream, what=what, error=str(exc))
            return True
        return isinstance(exc, TimeoutError) and stream in await self.after_timeout(what)

