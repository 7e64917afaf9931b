"""Which model directories jetrl may write: only those it made.

A directory jetrl creates a model in (`jetrl make-model`, `jetrl up`'s default tiny model) carries a
marker file (`MARKER`), written first. jetrl writes a model only into a path that does not exist yet
or that holds its marker. Any other directory is the user's: one that looks like a model (a config,
weights in any format, an index, tokenizer files, a GGUF) is used as it is; anything else there is
refused. Either way nothing in it is ever written, renamed or deleted.
"""

from __future__ import annotations

from pathlib import Path

MARKER = ".jetrl-made"
"""The file that marks a model directory as jetrl's own (it may rewrite what is inside)."""

MODEL_FILE_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json",
    "*.gguf", "tokenizer*", "special_tokens_map.json", "vocab.json", "vocab.txt", "merges.txt", "*.model",
    "adapter_config.json",
)
"""Top-level names that make a directory look like a model (HF, sharded, PyTorch `.bin`, GGUF, LoRA)."""


class NotOurs(RuntimeError):
    """A directory jetrl was asked to write a model into, but did not make; the message says what to do."""


def made_by_jetrl(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def model_files(path: str | Path) -> list[str]:
    """The names in `path` (top level) that belong to a model, sorted; [] when none or not a directory."""
    root = Path(path)
    if not root.is_dir():
        return []
    return sorted({p.name for pattern in MODEL_FILE_PATTERNS for p in root.glob(pattern)})


def looks_like_model(path: str | Path) -> bool:
    return bool(model_files(path))


def claim(path: str | Path) -> Path:
    """Make `path` a directory jetrl may write a model into: created (with the marker) when it does
    not exist, kept when it holds the marker. Raises NotOurs for anything else, naming what is there."""
    root = Path(path)
    if made_by_jetrl(root):
        return root
    if not root.exists():
        root.mkdir(parents=True)
        (root / MARKER).write_text("made by jetrl: it may rewrite the model in this directory\n")
        return root
    raise NotOurs(refusal(root))


def refusal(root: Path) -> str:
    """Why jetrl will not write into `root` (not its own), and what to do instead."""
    if not root.is_dir():
        return f"{root} exists and is not a directory: jetrl will not replace it; name a path that does not exist"
    found = model_files(root)
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        return (f"{root} holds a model jetrl did not make ({shown}; no {MARKER} marker): jetrl never writes into "
                f"it. Use it as model_path as it is, or name a path that does not exist for a new model")
    what = "is empty" if not any(root.iterdir()) else "holds files that are not a model"
    return (f"{root} {what} and was not made by jetrl (no {MARKER} marker): jetrl writes models only into a "
            f"path that does not exist yet; name one, or remove {root} yourself")


def check_model_dir(path: str | Path) -> None:
    """Raise NotOurs unless `path` can serve as a model: a model directory (used as it is), a directory
    jetrl made, or a path that does not exist yet (jetrl makes the default tiny model there)."""
    root = Path(path)
    if root.exists() and not made_by_jetrl(root) and not (root.is_dir() and looks_like_model(root)):
        raise NotOurs(refusal(root))
