"""`free_port` picks below the kernel's ephemeral range, so the ports of a server killed to be started
again are not handed to whoever binds port 0 meanwhile (another xdist worker, an outgoing connection):
a port that one picked is bindable, and the kernel's own picks, made while it is free, never land on it."""

from __future__ import annotations

import socket

from services.common.ports import _ephemeral_low, free_port


def test_picked_ports_are_free_and_below_the_range_the_kernel_hands_out() -> None:
    low = _ephemeral_low()
    picked = {free_port() for _ in range(20)}
    assert all(p < low for p in picked), (picked, low)
    kernel = set()
    for _ in range(200):  # what other processes get while a restarted server's ports stand free
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            kernel.add(s.getsockname()[1])
    assert not picked & kernel
    for port in picked:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
