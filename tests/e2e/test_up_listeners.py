"""`jetrl up` listens on loopback only: while a run trains (the trainer's torch.distributed
store and gloo group up, weights published and loaded), every listening socket of every process of
the run, read from the processes themselves, is on 127.0.0.1 or ::1. The groups it trains answer the
feeder's tagged prompts, copied by the rollout workers."""

from __future__ import annotations

import ipaddress
import signal
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
    # A step budget the stack cannot reach while it is read: the run is stopped (Ctrl-C) once every
    # service was read. A fixed 6-step run once ended, under a second suite's load, before the
    # trainer was read (`up` prints a step a little after the trainer took it).
    proc = start_up(tmp_path, "lis", 400, {**DEMO, "up": {**DEMO["up"], "stop_at_reward": 0}})
    assert proc.stdout is not None
    seen: dict[str, list[str]] = {}
    skipped: list[str] = []
    lines = []
    for line in proc.stdout:
        lines.append(line)
        # from step 3 on the whole stack is up and has trained and published; read again at each
        # later step until every service was read (a full CI run once read neither the trainer nor
        # the inference server at step 3), then stop the run (by step 60 at the latest)
        step = step_of(line)
        if step >= 3 and not SERVICES <= _names(seen):
            family = {p.pid: p for p in [*processes_of(tmp_path), *psutil.Process(proc.pid).children(recursive=True)]}
            seen.update(_listeners(list(family.values()), skipped))
        if step >= 3 and (SERVICES <= _names(seen) or step >= 60) and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            break
    out = "".join(lines) + finish(proc, timeout=600)
    assert proc.returncode == 130, out[-4000:]  # stopped by the signal, every process ended
    assert seen, f"no listener seen (no step 3 reached?):\n{out[-3000:]}"
    addresses = [a for socks in seen.values() for a in socks]
    assert SERVICES <= _names(seen), (seen, skipped)
    beyond = {p: [a for a in socks if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback] for p, socks in seen.items()}
    assert not any(beyond.values()), f"listening beyond loopback: {beyond} (all: {addresses})"
