"""A default `jetrl up` is locked per run: its bus admits only the run's own users (one per service,
each allowed only its subjects) and its inference server's admin routes want the run's admin key. A
client with no credentials, or with another service's, cannot read the prompts, publish a group or
an announcement, or swap the served weights; the run's own tools (`jetrl status`, `prompts push`,
`plot`) find their credentials in the run directory by themselves. And a stop with the bus already
dead (nats-server killed first, then SIGTERM) ends every service within its `shutdown_timeout_s`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from schemas.subjects import Subjects
from services.common.bus import connect
from services.common.nats_auth import NatsAuth
from services.runs import SECRETS_DIR
from tests.support.bus_users import refusal
from tests.support.up import ROOT, finish, start_up, step_of

RUN = "locked"
SHUTDOWN_S = 8.0
EXIT_SLACK_S = 3.0
"""Beyond its deadline, what a process may take to leave (the interpreter's own exit, a loaded machine)."""
SERVICES = ("trainer", "rollout", "reward", "weights", "inference")
S = Subjects(RUN)
PROMPTS_PULL = f"$JS.API.CONSUMER.MSG.NEXT.PROMPTS.{S.rollout_consumer}"
# (user, action, subject) the server must refuse: a service holding another's job
REFUSED = [
    *[(user, "subscribe", S.prompts_all) for user in ("reward", "weights", "track", "observer", "trainer")],
    *[(user, "publish", PROMPTS_PULL) for user in ("reward", "weights", "track", "observer", "trainer")],
    *[(user, "publish", S.trajectories) for user in ("reward", "weights", "track", "observer", "trainer", "prompts")],
    *[(user, "publish", S.weights_published) for user in ("rollout", "reward", "weights", "track", "observer", "prompts")],
]


def jetrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)


def env_of(run_dir: Path, name: str) -> dict[str, str]:
    pid = json.loads((run_dir / "procs.json").read_text())[name]
    return psutil.Process(pid).environ()


async def probe(url: str, secrets: Path, server: str) -> list[str]:
    wrong = []
    try:  # no credentials: not admitted at all, so nothing to read or publish
        nc = await connect(url, "intruder", connect_timeout_s=5, auth=NatsAuth())
        await nc.close()
        wrong.append("a client with no credentials was admitted")
    except ConnectionRefusedError as exc:
        assert "Authorization Violation" in str(exc), exc
    passwords = {p.name: p.read_text().strip() for p in secrets.iterdir()}
    errors = await asyncio.gather(*(refusal(url, user, passwords[user], action, subject) for user, action, subject in REFUSED))
    for (user, action, subject), err in zip(REFUSED, errors, strict=True):
        if "permissions violation" not in err.lower():
            wrong.append(f"{user} {action} {subject}: {err or 'not refused'}")
    async with httpx.AsyncClient(base_url=server, timeout=10) as http:
        poison = {"model_path": "/tmp/poison", "weight_version": "666666"}
        for headers in ({}, {"Authorization": f"Bearer {passwords['trainer']}"}):
            for route in ("/update_weights_from_disk", "/pause_generation", "/update_weights_from_tensor", "/any_admin_route_added_later"):
                r = await http.post(route, json=poison, headers=headers)
                if r.status_code != 401:
                    wrong.append(f"POST {route} with {list(headers) or 'no key'}: {r.status_code}")
        served = (await http.get("/model_info")).json()
        if str(served.get("weight_version")) == "666666":
            wrong.append("the poison version is served")
    return wrong


def served_url(run_dir: Path) -> str:
    """The inference server's URL, from its log's first line ("listening; loading model")."""
    first = (run_dir / "logs" / "inference-0.log").read_text().splitlines()[0]
    return str(json.loads(first)["url"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fork_server", [True, False], ids=["forked", "python-m"])
def test_a_default_up_admits_only_its_own_services_and_stops_within_its_deadlines_without_a_bus(tmp_path: Path,
                                                                                               fork_server: bool) -> None:
    config = {name: {"shutdown_timeout_s": SHUTDOWN_S} for name in SERVICES}
    config["trainer"]["checkpoint_every"] = 0
    # up kills what overran only long after the deadlines checked here
    config["up"] = {"stop_timeout_s": 60, "recording_max_bytes": 500_000_000, "fork_server": fork_server}
    proc = start_up(tmp_path, RUN, 400, config)
    run_dir = tmp_path / RUN
    secrets = run_dir / SECRETS_DIR
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if step_of(line) >= 2:
                break
        else:
            pytest.fail("".join(lines[-60:]))
        assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
        assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in secrets.iterdir()} == {"0o600"}

        # each process holds only its own: its user's password file, the admin key where it is needed
        # (/proc/<pid>/environ is what a process was started with: a forked one's is its fork server's,
        # which holds no credential at all; that a forked service gets exactly the environment it is
        # given, nothing more, is tests/integration/test_up_fork_server.py's)
        for name, user in (("trainer", "trainer"), ("rollout-0", "rollout"), ("reward", "reward"), ("weights-0", "weights"),
                           ("inference-0", None)):
            files = {v for v in env_of(run_dir, name).values() if v.startswith(str(secrets))}
            admin = {str(secrets / "inference-admin-key")} if name in ("trainer", "weights-0", "inference-0") else set()
            issuer = {str(secrets / "prompt-issuer-key")} if name == "trainer" else set()
            assert files == (set() if fork_server else {*([str(secrets / user)] if user else []), *admin, *issuer}), (name, files)
        server = served_url(run_dir)

        url = (run_dir / "nats.url").read_text().strip()
        assert asyncio.run(probe(url, secrets, server)) == []

        # the run's own tools find their credentials by themselves
        status = jetrl("status", f"run={RUN}", f"run_dir={tmp_path}", "format=json", "log_format=json")
        assert status.returncode == 0, status.stderr[-3000:]
        shown = json.loads(status.stdout)
        assert shown["weights"]["published_version"] >= 1
        # disk: each stream's use (the recording's cap set above) and the store's
        assert shown["bus"]["streams"]["TRAJECTORIES"]["max_bytes"] == 500_000_000
        assert "OBJ_WEIGHTS" in shown["bus"]["streams"] and shown["bus"]["store"]["used"] > 0, shown["bus"]
        data = tmp_path / "more.jsonl"
        data.write_text("".join(json.dumps({"prompt": "abc", "answer": "abc"}) + "\n" for _ in range(2)))
        pushed = jetrl("prompts", "push", str(data), "--run", RUN, "--run-dir", str(tmp_path))
        assert pushed.returncode == 0, pushed.stderr[-3000:]
        assert "no issuer key" not in pushed.stderr, "pushed with the run's own prompt issuer key"
        # the bus dies first; then a stop: every service ends within its shutdown_timeout_s
        procs = {name: psutil.Process(pid) for name, pid in json.loads((run_dir / "procs.json").read_text()).items()}
        conf = str(run_dir / "nats" / "nats-server.conf")
        nats = [p for p in psutil.process_iter(["cmdline"]) if conf in (p.info["cmdline"] or [])]
        assert len(nats) == 1
        nats[0].kill()
        psutil.wait_procs(nats, timeout=10)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        ended: dict[str, float] = {}
        while len(ended) < len(procs) and time.monotonic() - t0 < 60:
            for name, p in procs.items():
                try:  # it may end between the two questions
                    gone = not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    gone = True
                if name not in ended and gone:
                    ended[name] = time.monotonic() - t0
            time.sleep(0.1)  # polling the processes' state, not waiting blindly
        late = {name: round(ended.get(name, 99.0), 1) for name in procs if ended.get(name, 99.0) > SHUTDOWN_S + EXIT_SLACK_S}
        assert late == {}, f"past shutdown_timeout_s {SHUTDOWN_S}: {late}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out = "".join(lines) + finish(proc, timeout=120)
    assert proc.returncode == 130, out[-3000:]
    logs = {p.stem: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert not [name for name, text in logs.items() if '"service failed"' in text], "a stop without a bus is no failure"
    # (the trainer checkpoints at the stop unless its step was still waiting on a peer at the deadline,
    # e.g. a broadcast to a server that is stopping too: then that step is cancelled with the rest)
    assert "did not stop in time" not in out
    # the services themselves were refused nothing: every violation the server logged is a probe's
    logged = [x for x in (run_dir / "nats-server.log").read_text().splitlines() if "Violation" in x]
    assert {x.split('Subject "', 1)[1].split('"', 1)[0] for x in logged} == {subject for _, _, subject in REFUSED}, logged
    plotted = jetrl("plot", RUN, "--run-dir", str(tmp_path))  # a private server on the store, with the run's users
    assert plotted.returncode == 0, plotted.stderr[-3000:] + plotted.stdout[-2000:]
