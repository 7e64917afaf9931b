"""`jetrl up`'s fork server (services/up/fork/), a real server process forking real
children: a forked service is what `python -m <module>` would have been (its module as `__main__`, its
own environment, session, log, stdin, title and exit code), torch's threads follow the child's
OMP_NUM_THREADS, generators are not shared, nothing asked for is lost when the stack stops early, and
nothing outlives `jetrl up` when it dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from services.up.fork.client import HEAVY, ForkServer, forkable
from services.up.stack import Stack
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]

PROBE = '''
import json, os, random, sys
import numpy
facts = {
    "name": __name__, "argv0": sys.argv[0], "pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0),
    "env": dict(os.environ), "stdin": os.readlink("/proc/self/fd/0"),
    "cmdline": open("/proc/self/cmdline").read().replace("\\0", " ").strip(),
    "random": random.random(), "numpy": float(numpy.random.random()),
    "torch_threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
    "torch_preloaded": "torch" in sys.modules,
}
print(json.dumps(facts), flush=True)
code = os.environ.get("JETRL_PROBE__EXIT", "0")
if code == "raise":
    raise RuntimeError("the probe failed on purpose")
if code == "sleep":
    open(os.environ["JETRL_PROBE__READY"], "w").close()
    import threading
    threading.Event().wait()  # runs until it is killed
sys.exit(int(code))
'''


@pytest.fixture
def probe_path(tmp_path: Path) -> Path:
    """A package `probe` (its `__main__` reports what it sees) and `slow_import`, whose import blocks
    until a file exists (a heavy stage that has not finished)."""
    pkg = tmp_path / "pkgs" / "probe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(PROBE)
    os.mkfifo(tmp_path / "release")
    # a module that takes long to import: until the test opens the pipe's other end
    (tmp_path / "pkgs" / "slow_import.py").write_text(f"open({str(tmp_path / 'release')!r}).read()\n")
    (tmp_path / "pkgs" / "crash_import.py").write_text("import os\nos._exit(3)  # a library that kills its importer\n")
    return tmp_path / "pkgs"


def _env(pkgs: Path, **extra: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join([str(ROOT), str(pkgs)]), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "2", **extra}


def _server(tmp_path: Path, env: dict[str, str], heavy: tuple[str, ...] = ()) -> ForkServer:
    return ForkServer(env, tmp_path / "fork-server.log", heavy=heavy)


def _facts(log: Path) -> dict:
    return json.loads(next(line for line in log.read_text().splitlines() if line.startswith("{")))


def test_a_forked_service_is_what_python_m_would_have_been(tmp_path: Path, probe_path: Path) -> None:
    env = _env(probe_path)
    server = _server(tmp_path, env)
    try:
        log = tmp_path / "probe.log"
        own = env | {"JETRL_PROBE__VALUE": "mine", "JETRL_PROBE__EXIT": "3"}
        server.spawn("other", "probe", env | {"JETRL_OTHER__SECRET_FILE": "/not/yours"}, tmp_path / "other.log", 0, ())
        proc = server.spawn("probe", "probe", own, log, 0, ())
        assert proc.wait(60) == 3  # its exit code, as the server reaped it
        facts = _facts(log)
        assert facts["name"] == "__main__" and facts["argv0"].endswith("probe/__main__.py")
        assert facts["pid"] == proc.pid and facts["sid"] == proc.pid and facts["pgid"] == proc.pid  # a session of its own
        assert facts["env"] == own  # exactly its own: nothing of the server's environment or another service's
        assert facts["stdin"] == "/dev/null"
        assert facts["cmdline"].endswith("-m probe")  # `ps` names the service, not the fork server
    finally:
        server.stop(30)


def test_exit_codes_tracebacks_and_kills_are_reported(tmp_path: Path, probe_path: Path) -> None:
    env = _env(probe_path)
    server = _server(tmp_path, env)
    try:
        failed = server.spawn("failed", "probe", env | {"JETRL_PROBE__EXIT": "raise"}, tmp_path / "failed.log", 0, ())
        ready = tmp_path / "sleeping.ready"
        sleeping = server.spawn("sleeping", "probe", env | {"JETRL_PROBE__EXIT": "sleep", "JETRL_PROBE__READY": str(ready)},
                                tmp_path / "sleeping.log", 0, ())
        assert failed.wait(60) == 1
        assert "RuntimeError: the probe failed on purpose" in (tmp_path / "failed.log").read_text()
        wait_until("the sleeping probe to start", ready.exists, timeout_s=60)
        assert sleeping.poll() is None
        assert sleeping.pid is not None
        os.killpg(sleeping.pid, signal.SIGKILL)
        assert sleeping.wait(60) == -signal.SIGKILL
    finally:
        server.stop(30)


def test_children_get_their_own_generators_and_torch_threads(tmp_path: Path, probe_path: Path) -> None:
    env = _env(probe_path)
    server = _server(tmp_path, env, heavy=HEAVY)  # torch imported (with OMP_NUM_THREADS=2) before the forks
    try:
        procs = [server.spawn(f"p{i}", "probe", env | {"OMP_NUM_THREADS": "1", "JETRL_PROBE__I": str(i)}, tmp_path / f"p{i}.log", 0, (),
                              heavy=True) for i in range(2)]
        assert [p.wait(120) for p in procs] == [0, 0]
        facts = [_facts(tmp_path / f"p{i}.log") for i in range(2)]
        assert all(f["torch_preloaded"] and f["torch_threads"] == 1 for f in facts)  # the child's own OMP_NUM_THREADS
        assert facts[0]["random"] != facts[1]["random"] and facts[0]["numpy"] != facts[1]["numpy"]
    finally:
        server.stop(30)


def test_a_service_asked_for_before_the_heavy_imports_end_is_dropped_by_a_stop(tmp_path: Path, probe_path: Path) -> None:
    env = _env(probe_path)
    server = _server(tmp_path, env, heavy=("slow_import",))  # its heavy stage ends when the test says so
    try:
        proc = server.spawn("trainer", "services.trainer", env, tmp_path / "trainer.log", 0, ())
        server.end_requests()  # the stop, while the server still imports
        with open(tmp_path / "release", "w"):  # the import ends; the server then reads the end of its requests
            pass
        server.close(60)
        assert proc.pid is None and proc.poll() == -signal.SIGTERM  # dropped, never forked
        assert not (tmp_path / "trainer.log").exists()
    finally:
        server.stop(30)


def test_a_fork_server_that_dies_fails_what_it_had_not_started_saying_so(tmp_path: Path, probe_path: Path) -> None:
    env = _env(probe_path)
    server = _server(tmp_path, env, heavy=("crash_import",))
    try:
        proc = server.spawn("trainer", "services.trainer", env, tmp_path / "trainer.log", 0, ())
        assert proc.wait(60) == 1
        assert "the fork server ended before it started trainer" in (tmp_path / "trainer.log").read_text()
        with pytest.raises(RuntimeError, match="fork server has ended"):
            server.spawn("late", "probe", env, tmp_path / "late.log", 0, ())
    finally:
        server.stop(30)


def test_nothing_outlives_up_when_it_is_killed(tmp_path: Path, probe_path: Path) -> None:
    ready = tmp_path / "ready"
    script = textwrap.dedent(f"""
        import json, sys, time
        sys.path[:0] = [{str(ROOT)!r}]
        from pathlib import Path
        from services.up.fork.client import ForkServer
        env = {_env(probe_path)!r}
        server = ForkServer(env, Path({str(tmp_path / 'fs.log')!r}))
        proc = server.spawn("probe", "probe", env | {{"JETRL_PROBE__EXIT": "sleep", "JETRL_PROBE__READY": {str(ready)!r}}},
                            Path({str(tmp_path / 'probe.log')!r}), 0, ())
        while proc.pid is None:
            time.sleep(0.01)
        print(json.dumps({{"server": server.pid, "probe": proc.pid}}), flush=True)
        time.sleep(600)
    """)
    up = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert up.stdout is not None
        pids = json.loads(up.stdout.readline())
        wait_until("the probe to run", ready.exists, timeout_s=60, proc=up)
        survivors = [psutil.Process(pids["server"]), psutil.Process(pids["probe"])]
        up.kill()  # `jetrl up` dies without stopping anything: its fork server, then the probe, get SIGTERM
        _, alive = psutil.wait_procs(survivors, timeout=60)
        assert not alive, f"still running after jetrl up died: {alive}"
    finally:
        up.kill()
        up.wait()


def test_only_an_environment_that_differs_in_settings_is_forked() -> None:
    server = {"PATH": "/bin", "PYTHONPATH": "/x", "OMP_NUM_THREADS": "2"}
    assert forkable(server | {"JETRL_TRAINER__LR": "0.1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}, server)
    assert not forkable(server | {"PYTHONPATH": "/x:/mine"}, server)  # read when the server imported its modules
    assert not forkable(server | {"HF_HOME": "/elsewhere"}, server)
    assert not forkable({k: v for k, v in server.items() if k != "PATH"}, server)


def test_the_stack_forks_what_it_may_and_starts_the_rest_with_python_m(tmp_path: Path, probe_path: Path) -> None:
    env = _env(probe_path)
    stack = Stack(tmp_path / "run", env)
    stack.fork_from(_server(tmp_path, env))
    try:
        forked = stack.start("forked", "probe", {"JETRL_PROBE__EXIT": "0"})
        own = stack.start("own", "probe", {"JETRL_PROBE__EXIT": "0", "PYTHONPROFILEIMPORTTIME": "1"})
        assert forked.popen is not None and own.popen is not None
        assert isinstance(own.popen, subprocess.Popen) and not isinstance(forked.popen, subprocess.Popen)
        assert forked.popen.wait(60) == 0 and own.popen.wait(60) == 0
        wait_until("procs.json to name both", lambda: set(json.loads((tmp_path / "run" / "procs.json").read_text())) == {"forked", "own"},
                   timeout_s=30)
    finally:
        stack.stop(30)
