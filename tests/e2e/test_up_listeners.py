"""`jetrl up` listens on loopback only: while a short run trains (the trainer's torch.distributed
store and gloo group up, weights published and loaded), every listening socket of every process of
the run, read from the processes themselves, is on 127.0.0.1 or ::1. The groups it trains answer the
feeder's tagged prompts, copied by the rollout workers."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import psutil

from tests.support.up import DEMO, finish, processes_of, start_up, step_of


def _listeners(procs: list[psutil.Process], skipped: list[str]) -> dict[str, list[str]]:
    """{process: [address:port]} of every listening TCP socket and every unconnected UDP socket; a
    process that could not be read is named in `skipped` with the reason."""
    found: dict[str, list[str]] = {}
    for proc in procs:
        try:
            conns = proc.net_connections("inet")
            argv = proc.cmdline()
            name = " ".join([Path(argv[0]).name, *argv[1:3]])
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied) as e:
            skipped.append(f"{proc.pid}: {e!r}")
            continue
        for c in conns:
            listening = c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr)  # SOCK_DGRAM
            if listening:
                found.setdefault(f"{proc.pid} {name}", []).append(f"{c.laddr.ip}:{c.laddr.port}")
    return found


SERVICES = {"nats-server", "services.inference", "services.trainer"}


def _names(seen: dict[str, list[str]]) -> set[str]:
    return {w for p in seen for w in p.replace("-m ", "").split()}


def test_every_listener_of_jetrl_up_is_on_loopback(tmp_path: Path) -> None:
    proc = start_up(tmp_path, "lis", 6, DEMO)
    assert proc.stdout is not None
    seen: dict[str, list[str]] = {}
    skipped: list[str] = []
    lines = []
    for line in proc.stdout:
        lines.append(line)
        # from step 3 on the whole stack is up and has trained and published; read again at each
        # later step until every service was read (a full CI run once read neither the trainer nor
        # the inference server at step 3)
        if step_of(line) >= 3 and not SERVICES <= _names(seen):
            family = {p.pid: p for p in [*processes_of(tmp_path), *psutil.Process(proc.pid).children(recursive=True)]}
            seen.update(_listeners(list(family.values()), skipped))
    out = "".join(lines) + finish(proc, timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert seen, f"no listener seen (no step 3 reached?):\n{out[-3000:]}"
    addresses = [a for socks in seen.values() for a in socks]
    assert SERVICES <= _names(seen), (seen, skipped)
    beyond = {p: [a for a in socks if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback] for p, socks in seen.items()}
    assert not any(beyond.values()), f"listening beyond loopback: {beyond} (all: {addresses})"
