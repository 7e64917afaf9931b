"""The weights gathered bucket by bucket into rank 0's `BucketStream`, inside the training call, for
the broadcast: bucket n+1 is gathered while the sender has bucket n on the wire, and rank 0 never
holds more than the stream's `held` buckets (instead of a float32 copy of the whole model).

Every rank computes the same plan (the parameters in order, cut by `plan_buckets` at the served
dtype's size). Under ZeRO-3 a bucket's gather is collective (one all-gather of its parameters, every
rank): rank 0, which alone knows what the sender needs next (the next bucket, the first again after
the group was rebuilt, or nothing more), broadcasts the index before each one and the other ranks
follow. Under ZeRO-1/2 every rank holds the full parameters: rank 0 reads its own, the others are
not involved.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from services.weights.sender.bucket_stream import BucketStream, StreamSpec
from services.weights.sender.buckets import Bucket, plan_buckets


def streamable(settings: Any) -> bool:
    """Whether the weights can be gathered bucket by bucket. LoRA's weights are published merged
    (the adapters folded into their base layers), which needs the whole state: gathered in full."""
    return not settings.lora.enabled


def gather_stream(engine: Any, spec: StreamSpec, sink: BucketStream | None) -> None:
    """Every rank calls it (`sink` on rank 0 only): the buckets rank 0's stream asks for, until it
    says stop."""
    dtype = getattr(torch, spec.dtype)
    params = list(engine.engine.module.named_parameters())
    sizes = [_numel(p) * dtype.itemsize for _, p in params]
    plan = plan_buckets(sizes, spec.bucket_bytes)
    zero3 = engine.settings.zero_stage == 3
    # the module's own parameters are the fp32 master copy bit for bit when training in float32, and
    # its exact cast when training in the served dtype; otherwise read the optimizer's master copy
    from_module = engine.settings.dtype in ("float32", spec.dtype)
    collective = engine.world_size > 1 and (zero3 or not from_module)
    if not engine.is_main and not collective:
        return
    error: BaseException | None = None
    if sink is not None:
        sink.start(len(plan), sum(sizes))
    try:
        while True:
            i = sink.next_index() if sink is not None else -1
            if collective:
                i = _follow(i, engine.device)
            if i < 0:
                return
            part = [params[j] for j in plan[i]]
            tensors = _gather(engine, part, dtype, zero3=zero3, from_module=from_module)
            if sink is not None:
                sink.put(Bucket([n for n, _ in part], tensors, ""))
    except BaseException as exc:
        error = exc
        raise
    finally:
        if sink is not None:
            sink.close(error)


def _numel(p: torch.nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # a ZeRO-3 partitioned parameter is empty here


def _follow(index: int, device: torch.device) -> int:
    """Rank 0's choice of the next bucket, on every rank (on the engine's device: NCCL broadcasts
    GPU tensors only)."""
    t = torch.tensor([index], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


def _gather(engine: Any, part: list[tuple[str, torch.nn.Parameter]], dtype: torch.dtype, *, zero3: bool,
            from_module: bool) -> list[torch.Tensor]:
    """The bucket's parameters in `dtype`, as fresh contiguous tensors on rank 0 (empty elsewhere)."""
    main = engine.is_main
    if not from_module:
        from deepspeed.utils import safe_get_full_fp32_param

        out = []
        for _, p in part:
            full = safe_get_full_fp32_param(p)  # collective
            if main:
                out.append(_copy(full, dtype))
        return out
    if not zero3:
        return [_copy(p, dtype) for _, p in part]
    from services.trainer.model.engine import import_deepspeed

    with import_deepspeed().zero.GatheredParameters([p for _, p in part], modifier_rank=None):
        return [_copy(p, dtype) for _, p in part] if main else []


def _copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh CPU tensor of `t` in `dtype` (the sender holds it after the parameter changes again)."""
    return t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
