"""A NATS server whose port is taken as it starts: one `jetrl up` picked starts again on fresh ports;
one the user gave fails at once, naming the exit, instead of retrying into the same taken port; a
nonsensical attempt count is refused by name."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from services.bus.nats_cluster import NatsCluster
from services.bus.nats_server import ExitedEarly, NatsServer


def _hold(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_picked_port_taken_before_the_server_binds_it_is_replaced(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats")
    taken = server.port
    with _hold(taken):  # what another process could do between free_port and the server's bind
        server.start()
        try:
            assert server.port != taken
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
                assert conn.recv(4).startswith(b"INFO")  # a NATS server answers there
        finally:
            server.stop()


def test_a_given_port_that_is_taken_fails_without_retrying(tmp_path: Path) -> None:
    probe = NatsServer(tmp_path / "probe")  # only to pick two free ports
    with _hold(probe.port):
        server = NatsServer(tmp_path / "nats", port=probe.port, monitor_port=probe.monitor_port)
        with pytest.raises(ExitedEarly):
            server.start(attempts=3)
        assert server.port == probe.port  # not moved: the user asked for that port


@pytest.mark.parametrize("start", [lambda p: NatsServer(p).start(attempts=0), lambda p: NatsCluster(p, size=3).start(attempts=0)])
def test_zero_attempts_is_refused_by_name(tmp_path: Path, start) -> None:
    with pytest.raises(ValueError, match="attempts must be at least 1, got 0"):
        start(tmp_path / "bus")
