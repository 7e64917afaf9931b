"""The reference model of the KL term: the initial weights, frozen. It exists only while `ppo.kl_coef`
> 0, and where it lives is `reference_placement`:

- `device`: a full copy on every rank's device (the fastest; a whole model's memory per rank);
- `cpu`: a full copy in host memory, moved to the device for the reference passes of an update and
  back after them (device memory only while those passes run; two host-device copies per update);
- `zero3`: a DeepSpeed ZeRO-3 engine without an optimizer: each rank holds 1/world of the weights and
  the layers are gathered as the forward pass reaches them (every rank must run the same number of
  reference passes: with `ppo.kl_in: reward` and several ranks, rank 0 alone runs them, so that pair is
  refused).

With LoRA (`lora.enabled`) no copy is made: the reference is the trained model with its adapters
switched off, which is exactly the initial weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from services.trainer.settings import TrainerSettings


class Reference:
    """Frozen initial weights; `logits(inputs)` under no grad."""

    def __init__(self, settings: TrainerSettings, device: torch.device, world_size: int, deepspeed: Any,
                 lora_engine: Any = None) -> None:
        self.placement = settings.reference_placement
        self.device = device
        self._lora_engine = lora_engine  # the trained engine, its module a peft model: adapters off = reference
        self._resident = 0
        self.module: torch.nn.Module | None = None
        self.engine: Any = None
        sharded = settings.zero_stage == 3 if lora_engine is not None else self.placement == "zero3"
        if sharded and world_size > 1 and settings.ppo.kl_in == "reward":
            raise ValueError("ppo.kl_in reward with a ZeRO-3 sharded reference (reference_placement zero3, or LoRA on "
                             "zero_stage 3) and several ranks: rank 0 alone runs the reference passes there, which "
                             "ZeRO-3 cannot (use reference_placement device or cpu, or kl_in loss)")
        if lora_engine is not None:
            return
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if settings.dtype == "bfloat16" else torch.float32
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(settings.model_path, dtype=dtype,
                                                                      attn_implementation=settings.attn_implementation)
        model.eval().requires_grad_(False)
        if self.placement == "zero3":
            cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                                   "steps_per_print": 10**9}
            if settings.dtype == "bfloat16":
                cfg["bf16"] = {"enabled": True}
            self.engine, *_ = deepspeed.initialize(model=model, config=cfg)
            self.engine.eval()
            self.module = self.engine.module
        else:
            self.module = model.to(device) if self.placement == "device" else model

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """With `cpu` placement, the copy sits on the device inside this block (nested blocks move it
        once); the other placements are always ready."""
        if self.placement != "cpu" or self.module is None or self.device.type == "cpu":
            yield
            return
        self._resident += 1
        try:
            if self._resident == 1:
                self.module.to(self.device)
            yield
        finally:
            self._resident -= 1
            if self._resident == 0:
                self.module.to("cpu")

    @torch.no_grad()
    def logits(self, inputs: dict[str, Any]) -> torch.Tensor:
        if self._lora_engine is not None:
            module = self._lora_engine.module
            was_training = module.training
            module.eval()
            try:
                with module.disable_adapter():
                    return self._lora_engine(**inputs).logits.float()
            finally:
                module.train(was_training)
        model = self.engine if self.engine is not None else self.module
        assert model is not None
        with self.on_device():
            return model(**inputs).logits.float()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The copy's own parameters (none with LoRA: it shares the trained model's)."""
        return iter(()) if self.module is None else self.module.parameters()
