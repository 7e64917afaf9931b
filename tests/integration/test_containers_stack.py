"""The images really build and the stack really runs in containers: podman builds every service image
offline (a debootstrap base, wheels from a host-built wheelhouse), podman-compose brings the stack up
on an internal network with the CPU profile and rollout scaled to 3, and we check that every rollout
replica consumed prompts and that a trainer weight version reached the inference server.

Slow the first time on a machine (apt installs, debootstrap, image builds: all cached under
~/.cache/jetrl and in podman's store afterwards). Skips, naming what is missing, where containers
cannot run (no root to install podman, no user namespaces or cgroups). Each phase prints its time
(`pytest -s`). To time a cold run without touching the warm caches, point both caches elsewhere:
  JETRL_CACHE=/tmp/ctr/cache              the debootstrap tarball and the wheelhouse
  CONTAINERS_STORAGE_CONF=/tmp/ctr/storage.conf   a podman store with graphroot/runroot under /tmp/ctr"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
APT_PACKAGES = ["podman", "buildah", "runc", "netavark", "aardvark-dns", "catatonit", "debootstrap", "iptables"]
NEEDED_BINARIES = ["podman", "buildah", "runc", "debootstrap", "iptables"]
BASE_IMAGE = "localhost/jetrl-base:bookworm"
ROLLOUT_REPLICAS = 3

# the job stays under 10 minutes on a fresh machine (apt, debootstrap, every image build:
# about 4 minutes measured on the shared 2-core box; warm reruns 1-2)
pytestmark = pytest.mark.timeout(600)


def phase(name: str, start: float) -> None:
    print(f"phase {name}: {time.monotonic() - start:.0f} s", flush=True)


def sh(cmd: list[str], env: dict[str, str], timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def ensure_podman() -> str | None:
    """Install the container tools when missing (CI runs as root on a fresh machine); the reason to
    skip when that cannot be done."""
    if sys.platform != "linux":
        return f"containers need Linux (this is {sys.platform})"
    missing = [b for b in NEEDED_BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if not missing:
        return None
    if os.geteuid() != 0:
        return f"missing {', '.join(missing)} and not root to apt-get install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]):
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
        if result.returncode != 0:
            return f"{' '.join(cmd[:2])} failed: {result.stderr.strip()[-500:]}"
    return None


@pytest.fixture(scope="module")
def podman_env() -> dict[str, str]:
    start = time.monotonic()
    reason = ensure_podman()
    phase("container tools (apt)", start)
    if reason:
        pytest.skip(reason)
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}:/usr/sbin:/sbin",
        "CONTAINERS_CONF": str(INFRA / "podman" / "containers.conf"),
        "PYTHON": sys.executable,
    }
    start = time.monotonic()
    sh(["infra/scripts/make-base.sh"], env, timeout=400)
    phase("base image (debootstrap + import)", start)
    probe = sh(["podman", "run", "--rm", "--network", "none", BASE_IMAGE, "true"], env, check=False)
    if probe.returncode != 0:
        pytest.skip(f"podman cannot run a container here: {probe.stderr.strip()[-500:]}")
    return env


@pytest.fixture(scope="module")
def images(podman_env: dict[str, str]) -> dict[str, str]:
    """Build every image offline; {target: size line}."""
    start = time.monotonic()
    out = sh(["infra/scripts/build-images.sh", "--offline", "--base", BASE_IMAGE], podman_env, timeout=480).stdout
    print("".join(line + "\n" for line in out.splitlines() if re.match(r"== (built|wheelhouse) ", line)), end="")
    phase("wheelhouse + image builds", start)
    sizes = dict(re.findall(r"^jetrl-(\w+):\S+\s+(\d+ MB)$", out, re.MULTILINE))
    print("image sizes:", json.dumps(sizes))
    return sizes


def test_light_images_carry_no_deepspeed_and_no_cuda(images: dict[str, str], podman_env: dict[str, str]) -> None:
    assert set(images) == {"nats", "weights", "reward", "rollout", "inference", "trainer"}
    probe = (
        "import importlib.util as u, sys; mods = sys.argv[1:]; "
        "print({m: u.find_spec(m) is not None for m in mods}); "
        "t = u.find_spec('torch') and __import__('torch'); print('cuda', t and t.version.cuda)"
    )
    start = time.monotonic()
    for image in ("rollout", "reward", "weights", "inference", "trainer"):
        argv = ["podman", "run", "--rm", "--network", "none", "--entrypoint", "python3", f"jetrl-{image}:latest"]
        result = sh([*argv, "-c", probe, "deepspeed", "nvidia"], podman_env)
        found = result.stdout
        if image == "trainer":
            assert "'deepspeed': True" in found, found
        else:
            assert "'deepspeed': False" in found, f"{image}: {found}"
        assert "'nvidia': False" in found and "cuda None" in found, f"{image}: {found}"
    phase("image contents (5 containers)", start)


@pytest.fixture
def stack(images: dict[str, str], podman_env: dict[str, str], tmp_path: Path) -> Iterator[tuple[list[str], dict[str, str]]]:
    project = f"jetrlci{os.getpid()}"
    compose = ["podman-compose", "-p", project, "-f", "infra/compose.yaml", "-f", "infra/compose.ci.yaml", "--profile", "cpu"]
    # the NATS users' passwords the compose file mounts (one file per user)
    sh([sys.executable, "-m", "services.cli", "bus", "secrets", str(tmp_path / "secrets")], podman_env)
    env = {**podman_env, "JETRL_RUN": "ci", "TRAINER_STEPS": "1000", "REWARD_REPLICAS": "1", "JETRL_SECRETS": str(tmp_path / "secrets")}
    try:
        start = time.monotonic()
        sh([*compose, "up", "-d", "--scale", f"rollout={ROLLOUT_REPLICAS}"], env, timeout=240)
        phase("compose up", start)
        yield [*compose], {**env, "PROJECT": project}
    finally:
        start = time.monotonic()
        subprocess.run([*compose, "down", "-v", "-t", "5"], env=env, capture_output=True, timeout=180, cwd=ROOT)
        remove_project(env, project)
        phase("teardown", start)


def remove_project(env: dict[str, str], project: str) -> None:
    """Everything labelled with the compose project, and its pod: podman-compose 1.x `down` leaves
    scaled replicas beyond the first, one-shot containers, volumes, the network and an empty,
    unlabelled `pod_<project>` behind."""
    label = f"label=com.docker.compose.project={project}"

    def listed(*cmd: str) -> list[str]:
        return subprocess.run(["podman", *cmd, "--filter", label], env=env, capture_output=True, text=True, cwd=ROOT).stdout.split()

    for _ in range(5):  # containers that depend on others go first; retry what was refused
        ids = listed("ps", "-aq")
        if not ids:
            break
        subprocess.run(["podman", "rm", "-f", "--depend", "-t", "0", *ids], env=env, capture_output=True, timeout=120, cwd=ROOT)
    subprocess.run(["podman", "pod", "rm", "-f", "--ignore", f"pod_{project}"], env=env, capture_output=True, timeout=60, cwd=ROOT)
    for kind in ("volume", "network"):
        names = listed(kind, "ls", "-q")
        if names:
            subprocess.run(["podman", kind, "rm", "-f", *names], env=env, capture_output=True, timeout=60, cwd=ROOT)


def containers(env: dict[str, str], service: str) -> list[str]:
    out = sh(
        ["podman", "ps", "--format", "{{.Names}}", "--filter", f"label=io.podman.compose.project={env['PROJECT']}",
         "--filter", f"label=com.docker.compose.service={service}"],
        env,
    ).stdout
    return sorted(out.split())


def fetch(env: dict[str, str], container: str, url: str, timeout_s: float = 5.0) -> str:
    """GET `url` from inside `container` (the network is internal: the host cannot reach it); "" when
    it does not answer 2xx within `timeout_s`."""
    code = f"import urllib.request as u; print(u.urlopen({url!r}, timeout={timeout_s}).read().decode())"
    result = sh(["podman", "exec", container, "python3", "-c", code], env, timeout=60 + timeout_s, check=False)
    return result.stdout if result.returncode == 0 else ""


def episodes(metrics_text: str) -> float:
    values = [float(m) for m in re.findall(r'^jetrl_episodes_total\{[^}]*service="rollout"[^}]*\} (\S+)$', metrics_text, re.MULTILINE)]
    return max(values, default=0.0)


def logs(env: dict[str, str]) -> str:
    out = []
    project = f"label=io.podman.compose.project={env['PROJECT']}"
    names = sh(["podman", "ps", "-a", "--format", "{{.Names}}", "--filter", project], env, check=False).stdout.split()
    for name in names:
        tail = sh(["podman", "logs", "--tail", "15", name], env, check=False)
        out.append(f"--- {name}\n{tail.stdout[-1500:]}{tail.stderr[-1500:]}")
    return "\n".join(out)


def test_scaled_stack_consumes_prompts_on_every_replica_and_advances_weights(stack: tuple[list[str], dict[str, str]]) -> None:
    _, env = stack
    start = time.monotonic()
    seen: dict[str, Any] = {"per_replica": {}, "version": 0}

    def every_replica_consumed_and_weights_advanced() -> bool:
        replicas = containers(env, "rollout")
        seen["per_replica"] = {name: episodes(fetch(env, name, "http://127.0.0.1:9100/metrics")) for name in replicas}
        inference = containers(env, "inference")
        if inference:
            answer = fetch(env, inference[0], "http://127.0.0.1:30000/model_info")
            reported = json.loads(answer)["weight_version"] if answer else "0"
            seen["version"] = int(reported) if str(reported).isdigit() else 0  # SGLang's "default" is 0
        per = seen["per_replica"]
        return len(per) == ROLLOUT_REPLICAS and all(v > 0 for v in per.values()) and seen["version"] >= 1

    try:
        wait_until("every rollout replica to consume and the weights to advance", every_replica_consumed_and_weights_advanced,
                   timeout_s=300, interval_s=0.4)
    except TimeoutError as exc:
        raise AssertionError(f"episodes per replica {seen['per_replica']}, "
                             f"inference weight version {seen['version']}\n{logs(env)}") from exc
    per_replica = seen["per_replica"]
    assert len(per_replica) == ROLLOUT_REPLICAS
    # the side port's readiness sees NATS, the inference server and the reward service from inside. Its
    # inference check waits out a paused server (a weight load) for up to READY_POLL_TIMEOUT_S (30 s),
    # so one answer can take that long: asked with a longer timeout, and again until ready.
    for name in per_replica:
        ready: dict[str, Any] = {}

        def replica_ready(name: str = name, ready: dict[str, Any] = ready) -> bool:
            ready.clear()
            ready.update(json.loads(fetch(env, name, "http://127.0.0.1:9100/readyz", timeout_s=40) or "{}"))
            return ready.get("ready") is True

        try:
            wait_until(f"{name} to report ready", replica_ready, timeout_s=180, interval_s=1.0)
        except TimeoutError as exc:
            raise AssertionError(f"{name}: {ready}\n{logs(env)}") from exc
        assert {"inference reachable", "reward reachable"} <= set(ready["checks"]), ready
    phase("up -> every replica consumed, weights advanced, ready", start)
