"""Trace the memory of a trainer update that this machine cannot hold: the trainer's own code (TrainEngine,
DeepSpeed, PPOActor) runs on fake tensors (`torch._subclasses.FakeTensorMode`: shapes, dtypes and
storages, no data and no arithmetic) and every tensor storage it allocates is counted while it lives.

What it gives is the peak of live tensor bytes: a run's resident size is that plus the process's own
code and libraries (`trainer_memory.py` adds its resident size before the model) plus the allocator's
slack, and less the pages allocated and never written. Checked against real runs of the same code
(bench/README.md has the figures): a few percent either way. What it cannot give is time: nothing is
computed.

What the real code does is adapted where fake tensors cannot follow it, none of it allocating otherwise:
- the model is built from its config (weights random, as the bench's are) rather than read from
  safetensors, which would give real tensors;
- the module's `.to(device)` is skipped: it is already on the CPU, and fake parameters cannot be
  swapped in place;
- a fake tensor read as a number gives 0 (`.item()`, `float()`, `.tolist()`) or False (`bool()`):
  the norms and statistics the update logs, DeepSpeed's overflow check (no overflow: the step is
  taken) and the fused projection's "is there an entropy gradient" (none: no entropy term, as in
  the bench's settings); `torch.allclose` on fake tensors is True (the fused projection's probe of
  the model's logits, which real runs pass);
- the batch is made into tensors and cut into micro-batches on its real tensors, so the packing and
  the micro-batch plan (which read the rows' lengths) are the real run's.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated under this mode and still alive, and their peak since
    `reset_peak`. A storage is counted once however many tensors view it; a sparse tensor counts its
    values and indices."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.listeners: list[Callable[[int], None]] = []
        """Called with `live` after each allocation (a phase's peak is kept by one)."""
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: set[weakref.ref[Any]] = set()

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out

    def _count(self, t: torch.Tensor) -> None:
        parts = [t._values(), t._indices()] if t.is_sparse else [t]
        for part in parts:
            st = part.untyped_storage()
            if st in self._seen:
                continue
            size = st.nbytes()
            self._seen[st] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            self._refs.add(weakref.ref(st, self._freed(size)))
            for listener in self.listeners:
                listener(self.live)

    def _freed(self, size: int) -> Callable[[weakref.ref[Any]], None]:
        def freed(ref: weakref.ref[Any]) -> None:
            self.live -= size
            self._refs.discard(ref)

        return freed


def _numbers_read_as_zero(stack: ExitStack) -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    def patch(name: str, zero: Callable[[torch.Tensor], Any]) -> None:
        orig = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return zero(self) if isinstance(self, FakeTensor) else orig(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)
        stack.callback(setattr, torch.Tensor, name, orig)

    patch("item", lambda t: 0.0)
    patch("__float__", lambda t: 0.0)
    patch("__int__", lambda t: 0)
    patch("__bool__", lambda t: False)
    patch("tolist", lambda t: [0.0] * t.numel() if t.dim() else 0.0)
    allclose = torch.allclose

    def close(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        # the fused output projection's probe of the model's logits, which real runs pass
        return True if isinstance(a, FakeTensor) or isinstance(b, FakeTensor) else allclose(a, b, *args, **kwargs)

    torch.allclose = close  # type: ignore[assignment]
    stack.callback(setattr, torch, "allclose", allclose)


def _model_from_config(stack: ExitStack) -> None:
    import transformers

    auto = transformers.AutoModelForCausalLM
    orig = auto.from_pretrained

    def from_config(path: str, *args: Any, dtype: Any = None, attn_implementation: str | None = None, **kwargs: Any) -> Any:
        model = auto.from_config(transformers.AutoConfig.from_pretrained(path), dtype=dtype,
                                 attn_implementation=attn_implementation)
        model.to = types.MethodType(lambda self, *a, **k: self, model)  # on the CPU already
        return model

    auto.from_pretrained = from_config  # type: ignore[method-assign,assignment]
    stack.callback(setattr, auto, "from_pretrained", orig)


def _batch_cut_for_real(stack: ExitStack) -> None:
    """The mini-batch cut into micro-batches and packed on its real tensors (made from numpy, outside
    the fake mode) rather than on fake copies: the plan reads the rows' lengths, and it is the real
    run's. The model's forward takes them in as fake."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from services.trainer.model import actor
    from services.trainer.model.engine import TrainEngine

    tensors = actor.to_tensors

    def to_tensors(piece: dict[str, Any]) -> dict[str, Any]:
        with unset_fake_temporarily():
            return tensors(piece)

    actor.to_tensors = to_tensors
    stack.callback(setattr, actor, "to_tensors", tensors)
    orig = TrainEngine.micro_batches

    def micro_batches(self: TrainEngine, piece: dict[str, Any]) -> list[dict[str, Any]]:
        with unset_fake_temporarily():
            return orig(self, piece)

    TrainEngine.micro_batches = micro_batches  # type: ignore[method-assign]
    stack.callback(setattr, TrainEngine, "micro_batches", orig)


@contextmanager
def traced() -> Iterator[LiveBytes]:
    """Fake tensors for everything made inside (the batch's, made from numpy, stay real until an
    operation takes them), counted by the `LiveBytes` given."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with ExitStack() as stack:
        _numbers_read_as_zero(stack)
        _model_from_config(stack)
        _batch_cut_for_real(stack)
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        yield stack.enter_context(LiveBytes())  # innermost: it sees each op before the fake kernel runs
