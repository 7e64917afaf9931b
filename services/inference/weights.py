"""Load a HF checkpoint's safetensors into a live model, all or nothing.

Everything is read and checked (names, shapes) before the first parameter is touched, so a bad path,
a missing tensor or a shape mismatch leaves the old weights serving and the error names the tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only where weights are loaded, so a simulated server never pays for it
    import torch


class WeightLoadError(ValueError):
    """The checkpoint cannot be loaded into this model; the old weights are still in place."""


def read_checkpoint(model_path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(model_path)
    if not path.exists():
        raise WeightLoadError(f"model_path {str(model_path)!r} does not exist")
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"model_path {str(model_path)!r} has no *.safetensors files")
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as exc:  # a truncated or foreign file: name it
            raise WeightLoadError(f"cannot read {f}: {exc}") from exc
    return tensors


def load_safetensors_into(model: torch.nn.Module, model_path: str | Path) -> int:
    """Copy the checkpoint at `model_path` into `model` in place; returns the number of tensors."""
    tensors = read_checkpoint(model_path)
    state = model.state_dict()
    unexpected = sorted(set(tensors) - set(state))
    if unexpected:
        raise WeightLoadError(f"{model_path}: tensors the model does not have: {', '.join(unexpected[:5])}")
    for name, value in tensors.items():
        if tuple(value.shape) != tuple(state[name].shape):
            raise WeightLoadError(
                f"{model_path}: shape mismatch for {name}: checkpoint {tuple(value.shape)}, "
                f"model {tuple(state[name].shape)}"
            )
    # Tied weights (lm_head = embed_tokens) are saved once; they share storage here, so one copy
    # updates both. Anything else missing is an incomplete checkpoint.
    missing = [n for n, t in state.items() if n not in tensors and not _shares(t, state, tensors)]
    if missing:
        raise WeightLoadError(f"{model_path}: checkpoint lacks tensors: {', '.join(missing[:5])}")
    import torch

    with torch.no_grad():
        for name, value in tensors.items():
            state[name].copy_(value.to(state[name].dtype))
    return len(tensors)


def _shares(t: torch.Tensor, state: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> bool:
    ptr = t.data_ptr()
    return any(state[n].data_ptr() == ptr for n in loaded)
