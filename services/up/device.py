"""Where `jetrl up`'s computing services run (`up.device`, `up.dtype`), and what each is handed for it.

The trainer and the inference servers are the services that compute; each already has its own
device settings (docs/gpu.md). `up.device` sets them together, under the user's own `trainer:` and
`inference:` sections (theirs win):
- cpu: the trainer sees no GPU (DeepSpeed's CPU accelerator, gloo), the servers run on the CPU, in
  float32 unless `up.dtype` says otherwise.
- cuda: the trainer on the GPU (DeepSpeed's CUDA accelerator, NCCL on its one rank) and every server
  on the same GPU (the one-GPU colocated mode: each version reaches the servers by CUDA IPC handle,
  docs/weights.md "On one host"), in bfloat16 unless `up.dtype` says otherwise; the servers together
  may take `serving_memory_fraction` of the GPU's memory, the trainer the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.up.settings import UpSettings
from services.up.weights import IN_MEMORY

CUDA_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_HOME", "LD_LIBRARY_PATH")
"""What of `jetrl up`'s own environment the computing services get with `device: cuda` (which GPU,
and where CUDA's libraries are), beside what every service gets."""


class NoCuda(RuntimeError):
    """`device: cuda` asked for, and torch sees no CUDA GPU."""


def dtype_of(s: UpSettings) -> str:
    """The run's precision: `up.dtype`, or for `auto` bfloat16 on a GPU and float32 on the CPU."""
    if s.dtype != "auto":
        return s.dtype
    return "bfloat16" if s.device == "cuda" else "float32"


def check_device(s: UpSettings) -> None:
    """Raise NoCuda, naming what torch sees, when `device: cuda` is asked for and no GPU is usable.
    torch is imported only then (`jetrl up` on the CPU starts without it)."""
    if s.device != "cuda":
        return
    import os

    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        raise NoCuda(f"up.device is cuda, but torch {torch.__version__} ({build}) sees no CUDA GPU{hidden}: "
                     "run on a machine with an NVIDIA GPU and a CUDA build of torch, or set device=cpu")


def trainer_section(s: UpSettings) -> dict[str, Any]:
    """The trainer's settings for the device, under its own section: training precision and the dtype of the disk copies."""
    dtype = dtype_of(s)
    return {"dtype": dtype, "publish_dtype": dtype}


def with_weights_dtype(trainer: dict[str, Any], served: str) -> dict[str, Any]:
    """The trainer section (weights transport already chosen) with its in-memory versions sent in the
    dtype the servers serve (`served`: up's, or their section's), unless the section names one."""
    weights = trainer.get("weights")
    if not isinstance(weights, dict) or weights.get("transport") not in IN_MEMORY or "dtype" in weights:
        return trainer
    return {**trainer, "weights": {**weights, "dtype": served}}


def inference_section(s: UpSettings) -> dict[str, Any]:
    """Each inference server's settings for the device, under its own section."""
    out: dict[str, Any] = {"device": s.device, "dtype": dtype_of(s)}
    if s.device == "cuda":
        out["memory_fraction"] = round(s.serving_memory_fraction / s.inference_servers, 4)
    return out


def trainer_env(s: UpSettings, environ: Mapping[str, str]) -> dict[str, str]:
    """The trainer's environment for the device: DeepSpeed's accelerator; on the CPU no GPU visible
    (the trainer follows what torch sees), on a GPU `jetrl up`'s CUDA variables."""
    if s.device == "cpu":
        return {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    return {"DS_ACCELERATOR": "cuda", **serving_env(s, environ)}


def serving_env(s: UpSettings, environ: Mapping[str, str]) -> dict[str, str]:
    """An inference server's environment for the device: on a GPU, `jetrl up`'s CUDA variables."""
    if s.device == "cpu":
        return {}
    return {k: environ[k] for k in CUDA_ENV if k in environ}


def summary(s: UpSettings) -> dict[str, Any]:
    """What the start-of-run settings print and metrics.json keep of it."""
    out: dict[str, Any] = {"device": s.device, "dtype": dtype_of(s)}
    if s.device == "cuda":
        out["serving_memory_fraction"] = s.serving_memory_fraction
    return out
