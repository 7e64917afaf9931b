"""LoRA through peft: adapters on the chosen linear layers, the base weights frozen; the published
weights are the merged full weights, under the base model's own parameter names.

Why merged weights and not adapter files: every server loads a full HF directory the same way, so the
CPU server, SGLang, the disk and the broadcast weight paths and the weights agents need nothing new;
SGLang's LoRA loading (`/load_lora_adapter`) exists only in recent versions, serves adapters beside a
base model (each request must name its adapter) and has no in-memory update path. The cost is moving
the full model each version, as full fine-tuning does.
"""

from __future__ import annotations

from typing import Any

import torch

from services.trainer.settings import LoRASettings

_PREFIX = "base_model.model."


def apply(model: Any, cfg: LoRASettings) -> Any:
    """`model` wrapped by peft with adapters on `cfg.target_modules` (only they require grad). Raises
    when a target is not a linear layer (the merge here handles linear layers only)."""
    try:
        from peft import LoraConfig, get_peft_model
        from peft.tuners.lora import Linear
    except ImportError as e:  # an extra, not a core dependency (the CPU trainer image has none)
        raise ImportError("lora.enabled needs peft: pip install 'jetrl[lora]' (the trainer-gpu image has it)") from e

    targets: str | list[str] = "all-linear" if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, bias="none")
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:  # peft's message names the targets it did not find
        raise ValueError(f"lora.target_modules {cfg.target_modules}: {e}") from e
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in peft_model.named_modules():
        if isinstance(module, BaseTunerLayer) and not isinstance(module, Linear):
            raise ValueError(f"lora.target_modules: {name} is a {type(module).__name__}; only linear layers are supported")
    return peft_model


def base_model(module: Any) -> Any:
    """The HF model inside a peft wrapper (its config and `save_pretrained` write a plain HF dir)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def merge(state: dict[str, torch.Tensor], cfg: LoRASettings) -> dict[str, torch.Tensor]:
    """Full float32 weights under peft's names -> the merged weights under the base model's names:
    `W + alpha / rank x B A` for each adapted layer, everything else as it is."""
    scale = cfg.alpha / cfg.rank
    out: dict[str, torch.Tensor] = {}
    lora: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        key = name.removeprefix(_PREFIX)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key:
                lora.setdefault(key.split(marker)[0], {})[part] = tensor
                break
        else:
            out[key.replace(".base_layer.", ".")] = tensor
    for layer, ab in lora.items():
        weight = f"{layer}.weight"
        if weight not in out or set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA merge: {layer} has adapters {sorted(ab)} but no base weight {weight}")
        out[weight] = out[weight] + scale * (ab["lora_B"].float() @ ab["lora_A"].float()).to(out[weight].dtype)
    return out
