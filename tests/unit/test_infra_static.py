"""Offline checks of infra/: the Dockerfile (hadolint; JSON ENTRYPOINT and non-root USER per image;
DeepSpeed only in the trainer), the compose file (compose-spec schema; every env var a real setting),
the Kubernetes manifests (kustomize -> kubernetes-validate --strict; KEDA aimed at the real consumer)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from schemas.subjects import Subjects
from services.common.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
SERVICES = ("weights", "reward", "rollout", "inference", "trainer")
IMAGES = (*SERVICES, "nats")


def tool(name: str) -> str:
    """A dev-extra tool: next to this Python first (the venv), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: install the dev extra (pip install -e '.[dev]')")
    return found


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


# ---- Dockerfile -----------------------------------------------------------------------------------


def stages(dockerfile: str = "Dockerfile") -> dict[str, list[tuple[str, str]]]:
    """{stage name: [(INSTRUCTION, args), ...]} of infra/<dockerfile>, with line continuations joined."""
    text = re.sub(r"\\\n", " ", (INFRA / dockerfile).read_text())
    out: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, args = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            current = [(instr, args)]
            match = re.search(r"\bAS\s+(\S+)", args, re.IGNORECASE)
            out[match.group(1) if match else f"stage{len(out)}"] = current
        else:
            current.append((instr, args))
    return out


def chain(name: str, all_stages: dict[str, list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """A stage's instructions after those of the stages it is built FROM."""
    own = all_stages[name]
    parent = own[0][1].split()[0]
    return (chain(parent, all_stages) if parent in all_stages else []) + own


def test_hadolint_passes() -> None:
    result = run(tool("hadolint"), str(INFRA / "Dockerfile"))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("image", IMAGES)
def test_each_image_has_a_json_entrypoint_and_a_non_root_user(image: str) -> None:
    all_stages = stages()
    assert image in all_stages, f"infra/Dockerfile has no target {image!r}"
    instructions = chain(image, all_stages)
    entrypoints = [args for instr, args in instructions if instr == "ENTRYPOINT"]
    assert entrypoints, f"{image}: no ENTRYPOINT"
    entry = json.loads(entrypoints[-1])  # JSON (exec) form, or this raises
    assert isinstance(entry, list) and entry
    if image in SERVICES:
        assert entry == ["jetrl"], f"{image}: ENTRYPOINT {entry}"
        cmd = json.loads([args for instr, args in instructions if instr == "CMD"][-1])
        assert cmd[0] == image, f"{image}: CMD {cmd} does not run `jetrl {image}`"
    users = [args for instr, args in instructions if instr == "USER"]
    assert users, f"{image}: no USER (runs as root)"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{image}: USER {users[-1]}"


def requirement_names(name: str) -> set[str]:
    """Package names in infra/requirements/<name>.txt, following `-r` includes."""
    names: set[str] = set()
    for line in (INFRA / "requirements" / f"{name}.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            names |= requirement_names(line[3:].strip().removesuffix(".txt"))
        elif line:
            names.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower())
    return names


def test_only_the_trainer_image_carries_deepspeed_and_every_service_builds_from_its_list() -> None:
    all_stages = stages()
    for image in IMAGES:
        text = " ".join(args for _, args in chain(f"build-{image}", all_stages))
        assert f"requirements/{image}.txt" in text or image == "weights", f"build-{image} ignores its list"
        if image in SERVICES:
            final = " ".join(f"{i} {a}" for i, a in all_stages[image])
            assert "COPY --from=source /app /app" in final, f"{image}: no project source"
    for image in ("rollout", "reward", "weights", "inference"):
        assert "deepspeed" not in requirement_names(image), image
    assert "deepspeed" in requirement_names("trainer")


def test_torch_is_installed_once_and_its_layer_shared_by_the_torch_images() -> None:
    """The cold build's cost is torch: one pip install in one stage that rollout, inference and
    trainer build FROM, and no stage copies a virtualenv (a 1.2 GB COPY per image, and a hash of it
    on every warm rebuild)."""
    all_stages = stages()
    installs = [name for name, own in all_stages.items() if any(instr == "RUN" and '"torch==' in args for instr, args in own)]
    assert installs == ["build-torch"], installs
    for image in ("rollout", "inference", "trainer"):
        built_from = [args.split()[-1] for instr, args in chain(image, all_stages) if instr == "FROM"]
        assert "build-torch" in built_from, f"{image} builds from {built_from}"
    for image in ("weights", "reward", "nats"):
        assert "torch" not in requirement_names(image), image
    copies = [(name, args) for name, own in all_stages.items() for instr, args in own if instr == "COPY" and "/opt/jetrl " in f"{args} "]
    assert not copies, f"a virtualenv copied between stages: {copies}"


def test_image_requirements_are_project_dependencies() -> None:
    """The images install what pyproject.toml declares (no drift), and every declared runtime
    dependency lands in some image except the local-only tools named here."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(deps: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in deps}

    declared = names(project["dependencies"])
    image_extras = names(project["optional-dependencies"]["lora"])  # the trainer images train LoRA too
    in_images = set().union(*(requirement_names(i) for i in IMAGES))
    assert in_images <= declared | image_extras, f"not in pyproject.toml: {sorted(in_images - declared - image_extras)}"
    local_only = {"matplotlib", "setproctitle"}  # `jetrl plot` / `jetrl up` on a workstation (its fork server)
    assert declared - in_images <= local_only, f"in no image: {sorted(declared - in_images - local_only)}"


# ---- compose --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["compose.yaml", "compose.ci.yaml", "compose.cluster.yaml"])
def test_compose_file_matches_the_compose_spec(name: str) -> None:
    result = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(INFRA / name))
    assert result.returncode == 0, result.stdout + result.stderr


def _defaults(value: str) -> str:
    """Compose interpolation with the defaults: `${X:-d}` -> `d`."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def settings_class(service: str) -> type:
    import importlib

    module = importlib.import_module(f"services.{service}.settings")
    return next(c for c in vars(module).values() if isinstance(c, type) and getattr(c, "service", None) == service)


def check_env(service: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, secret: Path | None = None) -> object:
    """`secret`: a file standing in for the container's mounted NATS password (the path must exist)."""
    for key in [k for k in __import__("os").environ if k.startswith("JETRL_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.endswith("__NATS_AUTH__PASSWORD_FILE") and secret is not None:
            assert value.startswith("/run/secrets/nats-"), f"{key}={value}: not a mounted secret"
            value = str(secret)
        elif key.endswith("_KEY_FILE") and secret is not None:  # the trust keys (`jetrl bus secrets` writes them)
            assert value in ("/run/secrets/announce-key", "/run/secrets/inference-admin-key"), f"{key}={value}"
            value = str(secret)
        monkeypatch.setenv(key, value)
    return load_settings(settings_class(service))  # unknown keys and bad values raise here


def test_compose_environment_is_valid_settings_for_each_service(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    ci = yaml.safe_load((INFRA / "compose.ci.yaml").read_text())["services"]  # layered on top in CI
    secret = tmp_path / "password"
    secret.write_text("x")
    seen = set()
    for name, spec in compose["services"].items():
        image = _defaults(spec.get("image", ""))
        match = re.search(r"jetrl-(\w+):", image)
        if not match or name == "init":
            continue
        service = "bus" if name == "bus-init" else match.group(1)  # `jetrl bus init` runs in the weights image
        merged = {**(spec.get("environment") or {}), **(ci.get(name, {}).get("environment") or {})}
        env = {k: _defaults(v) for k, v in merged.items() if k.startswith("JETRL_")}
        settings = check_env(service, env, monkeypatch, secret)
        assert settings.nats_url == "nats://nats:4222" or service == "inference", name
        seen.add(service)
    assert seen == {*SERVICES, "bus"}
    assert compose["services"]["rollout"]["deploy"]["replicas"] == "${ROLLOUT_REPLICAS:-4}"


WRITERS = ("trainer", "rollout", "reward", "weights")
"""The services that write to the bus (bus-init only declares the streams; inference is not on it): a
timed-out write asks nats-server's monitor port whether the store is full (services/common/storefull.py)."""


def monitor_port(conf: str) -> int:
    """The monitor (`http_port`) a nats-server config file under infra/ enables."""
    found = re.search(r"^http_port:\s*(\d+)", (INFRA / conf).read_text(), re.MULTILINE)
    assert found, f"infra/{conf} enables no monitor port (http_port)"
    return int(found.group(1))


def assert_writers_ask(env: dict[str, str], monitor: str, where: str) -> None:
    """Each bus writer in `env` (JETRL_<SERVICE>__...) is given `monitor` as its nats_monitor_url."""
    for service in WRITERS:
        assert f"JETRL_{service.upper()}__NATS_URL" in env, f"{where}: {service} is not on the bus"
        got = env.get(f"JETRL_{service.upper()}__NATS_MONITOR_URL")
        assert got == monitor, f"{where}: {service}'s NATS_MONITOR_URL is {got!r}, not {monitor!r}: a full store would stall it unsaid"


def test_compose_gives_every_bus_writer_the_monitor_nats_server_enables(monkeypatch: pytest.MonkeyPatch) -> None:
    """compose.yaml (and compose.cluster.yaml layered on it): the URL is the `nats` service's
    monitor port, which its config file enables, and every writer's settings read it."""
    base = yaml.safe_load((INFRA / "compose.yaml").read_text())["services"]
    cluster = yaml.safe_load((INFRA / "compose.cluster.yaml").read_text())["services"]
    assert "./nats-server.conf:/etc/nats/nats-server.conf:ro" in base["nats"]["volumes"]
    assert "./nats-cluster.conf:/etc/nats/nats-server.conf:ro" in cluster["nats"]["volumes"]
    for layers, conf in (([base], "nats-server.conf"), ([base, cluster], "nats-cluster.conf")):
        env: dict[str, str] = {}
        for layer in layers:  # compose merges a service's environment over the files
            for name in (*WRITERS, "trainer-gpu"):
                env |= {k: _defaults(v) for k, v in (layer.get(name, {}).get("environment") or {}).items()}
        assert_writers_ask(env, f"http://nats:{monitor_port(conf)}", " + ".join(["compose.yaml", "compose.cluster.yaml"][: len(layers)]))
    assert "extends" in base["trainer-gpu"] and base["trainer-gpu"]["extends"] == "trainer"  # the GPU trainer inherits it
    for service in WRITERS:
        env = {k: _defaults(v) for k, v in base[service]["environment"].items() if k.startswith(f"JETRL_{service.upper()}__")}
        env = {k: v for k, v in env.items() if "PASSWORD_FILE" not in k and not k.endswith("_KEY_FILE")}
        assert check_env(service, env, monkeypatch).nats_monitor_url == "http://nats:8222"  # type: ignore[attr-defined]


def _common_env(docs: list[dict]) -> dict[str, str]:
    return next(d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("jetrl-common"))


def test_k8s_gives_every_bus_writer_the_monitor_of_its_nats() -> None:
    """Rendered by kustomize: the base's single nats (its Service's monitor port) and the cluster
    overlay's Helm-chart pods (the monitor port its values enable)."""
    docs = kustomize(INFRA / "k8s" / "base")
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "nats")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "monitor")
    assert port == monitor_port("nats-server.conf")
    assert_writers_ask(_common_env(docs), f"http://nats:{port}", "k8s base")
    values = yaml.safe_load((INFRA / "k8s" / "nats-helm-values.yaml").read_text())["config"]["monitor"]
    assert values["enabled"] is True
    cluster = _common_env(kustomize(INFRA / "k8s" / "overlays" / "cluster"))
    assert_writers_ask(cluster, f"http://nats-0.nats-headless:{values['port']}", "k8s overlays/cluster")
    assert all(cluster[f"JETRL_{s.upper()}__NATS_URL"].startswith("nats://nats-0.nats-headless:") for s in WRITERS)


# ---- Kubernetes -----------------------------------------------------------------------------------


def kustomize(path: Path) -> list[dict]:
    result = run(tool("kubectl"), "kustomize", str(path))
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.mark.parametrize("overlay", ["base", "overlays/keda", "overlays/cluster"])
def test_kustomize_output_validates_strictly(overlay: str, tmp_path: Path) -> None:
    docs = kustomize(INFRA / "k8s" / overlay)
    out = tmp_path / "rendered.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "rollout"), ("Deployment", "reward"), ("Deployment", "inference"), ("StatefulSet", "trainer")} <= kinds
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                assert "readinessProbe" in c and "livenessProbe" in c, f"{doc['metadata']['name']}/{c['name']}: no probes"
                assert c["resources"]["requests"], f"{doc['metadata']['name']}/{c['name']}: no resource requests"


def test_k8s_settings_are_valid_and_keda_scales_on_the_real_prompt_consumer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    base = INFRA / "k8s" / "base"
    assert (base / "nats-server.conf").read_text() == (INFRA / "nats-server.conf").read_text(), "copy of infra/nats-server.conf drifted"
    env = dict(line.split("=", 1) for line in (base / "common.env").read_text().splitlines() if "=" in line)
    secret = tmp_path / "password"
    secret.write_text("x")
    runs = set()
    for service in (*SERVICES, "bus"):
        mine = {k: v for k, v in env.items() if k.startswith(f"JETRL_{service.upper()}__")}
        settings = check_env(service, mine, monkeypatch, secret)
        if service != "inference":  # the only one not on the bus
            runs.add(settings.run)
    assert len(runs) == 1, f"services disagree on the run: {runs}"
    docs = kustomize(INFRA / "k8s" / "overlays" / "keda")
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"], "KEDA overlay must drop the CPU HPA"
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    trigger = scaled["spec"]["triggers"][0]["metadata"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "rollout"
    assert trigger["stream"] == "PROMPTS"
    assert trigger["consumer"] == Subjects(runs.pop()).rollout_consumer


def test_the_jetrl_launcher_guards_main_so_process_pools_do_not_rerun_the_service() -> None:
    """spawn/forkserver children (the reward pool) re-import the main script: an unguarded launcher
    would start a second service in every child."""
    launcher = " ".join(args for instr, args in stages()["launcher"] if instr == "RUN")
    assert 'if __name__ == "__main__":' in launcher and "from services.cli import main" in launcher


def test_rollout_readiness_pings_the_reward_service_by_its_real_name() -> None:
    from services.reward.service import SERVICE_NAME

    assert f'"$SRV.PING.{SERVICE_NAME}"' in (ROOT / "services" / "rollout" / "service.py").read_text()


def test_the_cluster_node_config_is_valid_for_nats_server() -> None:
    """compose.cluster.yaml's node config, as nats-server itself reads it (`-t`: check and exit)."""
    from services.bus.nats_server import find_binary

    env = {**os.environ, "NATS_NODE": "nats-2"}
    proc = subprocess.run([find_binary(), "-c", str(INFRA / "nats-cluster.conf"), "-t"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


IMAGE_ENTRY_MODULES = {
    "rollout": ("services.rollout.service", "services.rollout.engine", "services.rollout.reward_batching",
                "services.rollout.workflows.rlvr"),
    "inference": ("services.inference.server", "services.inference.model_backend"),
    "reward": ("services.reward.service", "services.reward.pool", "services.reward.worker"),
    "weights": ("services.weights.agent.agent",),
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_closure(names: set[str]) -> set[str]:
    """`names` and every distribution they require (as installed here), normalised."""
    from importlib import metadata

    todo, seen = [_norm(n) for n in names], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_norm(re.split(r"[<>=!~\[; (]", r, maxsplit=1)[0]) for r in requires if "extra ==" not in r]
    return seen


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names a file imports when it is imported: module-level statements (inside `if`, not
    `if TYPE_CHECKING`, not under `try`, which is how optional imports are written)."""
    import ast

    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)

    visit(ast.parse(path.read_text()).body)
    return names


def test_what_a_service_imports_is_installed_in_its_image() -> None:
    """Every third-party package the modules of ours that a light image's service loads import at module
    level is in that image's requirements (or required by one of them): the rollout image once lacked
    orjson, which only the stack built from the images showed (every rollout replica died at import).
    Only our own modules' imports are checked: a library's optional imports (what it loads where installed)
    are its business."""
    from importlib import metadata

    dists = metadata.packages_distributions()
    problems = []
    for image, modules in IMAGE_ENTRY_MODULES.items():
        code = ("import importlib, json, sys\n"
                f"for m in {list(modules)!r}: importlib.import_module(m)\n"
                "print(json.dumps(sorted(getattr(m, '__file__', None) or '' for n, m in list(sys.modules.items())\n"
                "                        if n.split('.')[0] in ('services', 'schemas'))))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, check=True)
        ours = [Path(f) for f in json.loads(out.stdout.strip().splitlines()[-1]) if f]
        imported = set().union(*(_module_level_imports(f) for f in ours))
        needed = {_norm(d) for top in imported for d in dists.get(top, [])} - {"jetrl"}
        missing = needed - _installed_closure(requirement_names(image))
        if missing:
            problems.append(f"{image}: our modules import {sorted(missing)}, which infra/requirements/{image}.txt does not install")
    assert not problems, problems
