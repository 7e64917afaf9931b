"""Offline checks of the GPU variants (nothing CUDA is built or pulled here): infra/Dockerfile.gpu
(hadolint; trainer-gpu installs CUDA torch and builds DeepSpeed's ops, inference-gpu runs SGLang through
`jetrl inference`; non-root; DS_ACCELERATOR never pinned), compose's gpu profile and the k8s gpu
overlay (GPUs requested for the trainer and SGLang), while the CPU images stay the default."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.unit.test_infra_static import (
    INFRA,
    ROOT,
    _defaults,
    check_env,
    kustomize,
    requirement_names,
    run,
    stages,
    tool,
)

GPU_IMAGES = {"trainer-gpu": "trainer", "inference-gpu": "inference"}


def test_hadolint_passes_on_the_gpu_dockerfile() -> None:
    result = run(tool("hadolint"), str(INFRA / "Dockerfile.gpu"))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("image", "service"), GPU_IMAGES.items())
def test_each_gpu_image_runs_its_service_as_a_non_root_user(image: str, service: str) -> None:
    own = stages("Dockerfile.gpu")[image]
    assert json.loads([a for i, a in own if i == "ENTRYPOINT"][-1]) == ["jetrl"]
    assert json.loads([a for i, a in own if i == "CMD"][-1])[0] == service
    assert [a for i, a in own if i == "USER"][-1].split(":")[0] not in ("root", "0")
    assert "--from=source /app /app" in " ".join(a for i, a in own if i == "COPY")


def test_the_gpu_trainer_has_cuda_torch_and_builds_deepspeeds_ops_and_the_cpu_images_stay_cpu() -> None:
    gpu = stages("Dockerfile.gpu")
    trainer = " ".join(f"{i} {a}" for i, a in gpu["trainer-gpu"])
    assert re.search(r"TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu\d+", trainer)
    assert "nvidia/cuda" in (INFRA / "Dockerfile.gpu").read_text().split("FROM", 1)[0]  # a CUDA devel base (nvcc)
    assert "DS_BUILD_FUSED_ADAM" in trainer and "--no-build-isolation" in trainer
    assert {"deepspeed", "peft"} <= requirement_names("trainer-gpu")
    inference = " ".join(f"{i} {a}" for i, a in gpu["inference-gpu"])
    assert "JETRL_INFERENCE__ENGINE=sglang" in inference and "import sglang" in inference
    assert "torch" not in requirement_names("base")  # SGLang's own torch stays
    cpu = " ".join(f"{i} {a}" for _, own in stages().items() for i, a in own)
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in cpu
    for name in ("Dockerfile", "Dockerfile.gpu"):  # the trainer picks cuda or cpu from what torch sees
        assert not re.search(r"^\s*(ENV|ARG)\b.*DS_ACCELERATOR", (INFRA / name).read_text(), re.MULTILINE), name


def test_gpu_image_requirements_are_declared_by_the_project() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower()
                for d in (*project["dependencies"], *project["optional-dependencies"]["lora"])}
    assert requirement_names("trainer-gpu") <= declared


def _compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())["services"]


def _gpu_devices(spec: dict) -> list[dict]:
    return spec.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_the_gpu_profile_gives_sglang_and_the_trainer_a_gpu_and_the_cpu_profile_none(monkeypatch: pytest.MonkeyPatch,
                                                                                       tmp_path: Path) -> None:
    services = _compose()
    secret = tmp_path / "secret"  # stands in for the mounted NATS password and trust keys
    secret.write_text("x")
    gpu = {n for n, s in services.items() if "gpu" in s.get("profiles", ["cpu", "gpu"])}
    cpu = {n for n, s in services.items() if "cpu" in s.get("profiles", ["cpu", "gpu"])}
    assert {"inference-sglang", "trainer-gpu"} <= gpu and not {"inference-sglang", "trainer-gpu"} & cpu
    assert {"inference", "trainer"} <= cpu and not {"inference", "trainer"} & gpu  # one trainer per profile
    for name in ("inference-sglang", "trainer-gpu"):
        assert any("gpu" in d["capabilities"] and d["driver"] == "nvidia" for d in _gpu_devices(services[name])), name
    assert not any(_gpu_devices(services[n]) for n in cpu)
    assert "jetrl-inference-gpu:" in services["inference-sglang"]["image"]
    assert "jetrl-trainer-gpu:" in services["trainer-gpu"]["image"]
    assert services["trainer-gpu"]["extends"] == "trainer"
    # the settings the GPU services run with are real settings (the trainer's through `extends`)
    trainer_env = {**services["trainer"]["environment"], **(services["trainer-gpu"].get("environment") or {})}
    check_env("trainer", {k: _defaults(v) for k, v in trainer_env.items() if k.startswith("JETRL_")}, monkeypatch, secret)
    sglang_env = services["inference-sglang"]["environment"]
    settings = check_env("inference", {k: _defaults(v) for k, v in sglang_env.items() if k.startswith("JETRL_")}, monkeypatch, secret)
    assert settings.engine == "sglang"  # type: ignore[attr-defined]


def test_the_k8s_gpu_overlay_validates_and_requests_gpus_for_the_trainer_and_sglang(tmp_path: Path) -> None:
    docs = kustomize(INFRA / "k8s" / "overlays" / "gpu")
    out = tmp_path / "rendered.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    containers = {(d["metadata"]["name"], c["name"]): c for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                  for c in d["spec"]["template"]["spec"]["containers"]}
    for key, image in ((("inference", "inference"), "jetrl-inference-gpu"), (("trainer", "trainer"), "jetrl-trainer-gpu")):
        c = containers[key]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1", key
        assert image in c["image"], key
        assert c["readinessProbe"] and c["livenessProbe"], key
    inference = containers[("inference", "inference")]
    assert {"name": "JETRL_INFERENCE__ENGINE", "value": "sglang"} in inference["env"]
    gpu_users = {k for k, c in containers.items() if "nvidia.com/gpu" in c["resources"].get("limits", {})}
    assert gpu_users == {("inference", "inference"), ("trainer", "trainer")}
    base = kustomize(INFRA / "k8s" / "base")  # the default stays CPU
    assert not any("nvidia.com/gpu" in json.dumps(d) for d in base)
