"""Bulk read of a pull consumer on a private plain-socket connection, in a worker thread.

Profiling the agent's 1 GB download showed its event loop thread busy the whole time: nats-py reads
the socket 32 KiB at a time (its StreamReader also pauses the socket at 64 KiB buffered) and copies
every byte about six times (socket -> StreamReader -> read() -> parser buffer -> slice -> bytes ->
join) with Python work per 32 KiB, ~3.5 CPU-s per GB on top of hashing. This module speaks the
same NATS client protocol (CONNECT, SUB, PUB to `$JS.API.CONSUMER.MSG.NEXT`, MSG/HMSG) on its own
blocking socket: `recv_into` a reusable buffer, each chunk's payload is hashed and written straight
from that buffer (a memoryview; hashlib and file writes release the GIL), with a window of pull
requests in flight sized in bytes (never near the slow-consumer limit). Nothing runs on the event
loop, so the loop stays free for the agent's other work.

Only plain TCP with user/password or token auth is supported; `connection_params` returns None for
anything else (TLS, credentials files, nkeys) and the caller uses nats-py instead.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

WINDOW_BYTES = 32 * 1024 * 1024
"""Bytes requested but not yet received, at most: half of nats-server's default max_pending (64 MB)."""
REQUEST_BYTES = 8 * 1024 * 1024
"""Bytes asked for per pull request."""
WRITE_QUEUE_BYTES = 16 * 1024 * 1024
"""Received bytes waiting for the writer thread, at most."""
REQUEST_EXPIRES_S = 60.0
RECV_TIMEOUT_S = 0.5
"""The socket timeout: how often the thread checks for a stop request."""


class Unsupported(Exception):
    """This connection cannot be made here (TLS, other auth); use nats-py instead."""


class PullError(RuntimeError):
    """The server refused or broke off the read."""


class _Hash(Protocol):
    def update(self, data: Any, /) -> None: ...


@dataclass(frozen=True)
class ConnParams:
    host: str
    port: int
    user: str | None = None
    password: str | None = None
    token: str | None = None


def connection_params(nc: Any) -> ConnParams | None:
    """Where and how to open a plain connection like `nc`'s, or None if this module cannot."""
    opts = getattr(nc, "options", {}) or {}
    if opts.get("tls") or opts.get("user_credentials") or opts.get("nkeys_seed") or opts.get("signature_cb"):
        return None
    uri = getattr(nc, "connected_url", None)
    if uri is None or uri.scheme not in ("nats", "") or not uri.hostname:
        return None
    user, password, token = opts.get("user"), opts.get("password"), opts.get("token")
    if uri.username and uri.password:
        user, password = uri.username, uri.password
    elif uri.username:
        token = uri.username
    return ConnParams(uri.hostname, uri.port or 4222, user, password, token)


class _Conn:
    def __init__(self, params: ConnParams, stop: threading.Event, buffer_size: int) -> None:
        self.stop = stop
        self.buf = bytearray(buffer_size)
        self.mv = memoryview(self.buf)
        self.start = self.end = 0
        try:
            self.sock = socket.create_connection((params.host, params.port), timeout=5)
        except OSError as exc:
            raise Unsupported(f"cannot connect to {params.host}:{params.port}: {exc}") from exc
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
            op, rest = self._line(deadline=time.monotonic() + 5)
            if op != b"INFO":
                raise Unsupported(f"unexpected greeting {op!r}")
            info = json.loads(rest)
            if info.get("tls_required") or info.get("nonce"):
                raise Unsupported("server wants TLS or nkey auth")
            if not info.get("headers", False):
                raise Unsupported("server without headers support")
            connect = {"verbose": False, "pedantic": False, "lang": "python3", "version": "jetrl-rawpull",
                       "protocol": 1, "headers": True, "no_responders": True, "name": "jetrl-weights-rawpull"}
            if params.user is not None:
                connect.update(user=params.user, **{"pass": params.password or ""})
            if params.token is not None:
                connect["auth_token"] = params.token
            self.send(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
            while True:
                op, rest = self._line(deadline=time.monotonic() + 5)
                if op == b"PONG":
                    break
                if op == b"-ERR":
                    raise Unsupported(f"server refused the connection: {rest.decode(errors='replace')}")
            self.sock.settimeout(RECV_TIMEOUT_S)
        except BaseException:
            self.sock.close()
            raise

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _fill(self, deadline: float) -> None:
        """Read more bytes into the buffer (compacting it first when full)."""
        if self.end == len(self.buf):
            if self.start == 0:
                raise PullError("message larger than the read buffer")
            n = self.end - self.start
            self.mv[:n] = self.mv[self.start : self.end]
            self.start, self.end = 0, n
        while True:
            if self.stop.is_set():
                raise PullError("stopped")
            if time.monotonic() > deadline:
                raise TimeoutError("no data from the server")
            try:
                n = self.sock.recv_into(self.mv[self.end :])
            except socket.timeout:
                continue
            if not n:
                raise PullError("server closed the connection")
            self.end += n
            return

    def _line(self, deadline: float) -> tuple[bytes, bytes]:
        """The next protocol line as (op, rest), answering PINGs on the way."""
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i < 0:
                self._fill(deadline)
                continue
            line = bytes(self.mv[self.start : i])
            self.start = i + 2
            op, _, rest = line.partition(b" ")
            if op == b"PING":
                self.send(b"PONG\r\n")
                continue
            if op == b"+OK":
                continue
            return op.upper(), rest

    def _payload(self, size: int, deadline: float) -> memoryview:
        while self.end - self.start < size + 2:
            self._fill(deadline)
        view = self.mv[self.start : self.start + size]
        self.start += size + 2
        return view


def pull_chunks(
    params: ConnParams,
    api_prefix: str,
    stream: str,
    consumer: str,
    count: int,
    chunk_size: int,
    dest: BinaryIO,
    sha: _Hash,
    stop: threading.Event,
    idle_timeout_s: float,
) -> int:
    """Read `count` messages of the pull consumer (AckPolicy.NONE) in order, hashing and writing each
    payload; returns the bytes written. Blocking: run it in a thread and set `stop` to end it early."""
    conn = _Conn(params, stop, buffer_size=max(8 * 1024 * 1024, 2 * chunk_size + 65536))
    writer = _Writer(dest, depth=max(2, WRITE_QUEUE_BYTES // chunk_size))
    try:
        inbox = f"_INBOX.jetrl.{threading.get_ident()}.{time.monotonic_ns()}"
        conn.send(f"SUB {inbox} 1\r\n".encode())
        per_request = max(1, REQUEST_BYTES // chunk_size)
        window = max(2 * per_request, WINDOW_BYTES // chunk_size)
        next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        requested = received = written = 0
        while received < count:
            while requested < count and requested - received + per_request <= window:
                batch = min(per_request, count - requested)
                body = json.dumps({"batch": batch, "expires": int(REQUEST_EXPIRES_S * 1e9)}).encode()
                conn.send(f"PUB {next_subject} {inbox} {len(body)}\r\n".encode() + body + b"\r\n")
                requested += batch
            deadline = time.monotonic() + idle_timeout_s
            op, rest = conn._line(deadline)
            args = rest.split()
            if op == b"MSG":
                view = conn._payload(int(args[-1]), deadline)
            elif op == b"HMSG":
                hsize, total = int(args[-2]), int(args[-1])
                whole = conn._payload(total, deadline)
                status = bytes(whole[:hsize]).split(b"\r\n", 1)[0][len(b"NATS/1.0") :].strip()
                if status:
                    if status.startswith(b"100"):  # heartbeat / flow control: not data
                        continue
                    raise PullError(f"pull request answered {status.decode(errors='replace')}")
                view = whole[hsize:]
            elif op == b"-ERR":
                raise PullError(f"server error: {rest.decode(errors='replace')}")
            else:
                continue  # INFO updates and the like
            data = bytes(view)  # the buffer is reused; one copy lets the write overlap the next hash
            writer.put(data)
            sha.update(data)
            written += len(data)
            received += 1
        writer.finish()
        return written
    finally:
        writer.close()
        conn.close()


class _Writer:
    """Writes chunks to `dest` in its own thread, so the file write overlaps hashing and receiving."""

    def __init__(self, dest: BinaryIO, depth: int) -> None:
        self.dest = dest
        self.queue: queue.Queue[bytes | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="weights-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (data := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.dest.write(data)
                except BaseException as exc:  # reported by put/finish
                    self.error = exc

    def put(self, data: bytes) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(data)

    def finish(self) -> None:
        self.close()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
