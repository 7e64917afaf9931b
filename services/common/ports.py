"""The one way jetrl picks a port for a server it starts (nats-server, inference servers, side ports,
the tests' and benches' servers)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST_PICKED_PORT = 10000


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (Linux: ip_local_port_range; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to, picked at random below the kernel's ephemeral range. The kernel
    never hands those out by itself (a bind to port 0, the local end of an outgoing connection), so a
    server killed and started again on its ports (a node brought back, a test's fault) finds them still
    free although other processes keep opening sockets meanwhile. Falls back to a port the kernel picks."""
    high = _ephemeral_low()
    for _ in range(50 if high > LOWEST_PICKED_PORT else 0):
        port = random.randrange(LOWEST_PICKED_PORT, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
