"""The memory tracer bench/trainer_memory.py uses for a path this machine cannot hold: it counts each
storage once while it lives, views included, sparse tensors by their parts, and it puts back what it
adapted for the trace when it is done."""

from __future__ import annotations

import gc

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from bench.support.tracemem import LiveBytes, traced


def test_live_bytes_counts_each_storage_once_while_it_lives_and_keeps_the_peak() -> None:
    with FakeTensorMode(), LiveBytes() as live:
        a = torch.empty(1000, 1000)  # 4 MB, never made: a fake tensor
        view = a[:10]
        b = a.t().contiguous()  # a copy: 4 MB more
        assert isinstance(a, FakeTensor)
        assert live.live == live.peak == 8_000_000
        del b
        gc.collect()
        assert live.live == 4_000_000 and live.peak == 8_000_000
        live.reset_peak()
        assert live.peak == 4_000_000
        del a
        gc.collect()
        assert live.live == 4_000_000  # the view still holds the storage
        del view
        gc.collect()
        assert live.live == 0


def test_a_sparse_tensor_counts_its_values_and_indices() -> None:
    with FakeTensorMode(), LiveBytes() as live:
        dense = torch.zeros(100, 8)
        before = live.live
        sparse = dense.to_sparse()
        assert sparse.is_sparse
        nnz = sparse._nnz()
        assert live.live - before == nnz * 8 * 4 + 2 * nnz * 8  # float32 values, int64 (2, nnz) indices


def test_the_adaptations_are_undone_after_the_trace() -> None:
    import transformers

    from services.trainer.model import actor
    from services.trainer.model.engine import TrainEngine

    before = (torch.Tensor.item, torch.allclose, transformers.AutoModelForCausalLM.from_pretrained,
              actor.to_tensors, TrainEngine.micro_batches)
    with traced() as live:
        x = torch.ones(4)
        assert isinstance(x, FakeTensor) and x.sum().item() == 0.0  # a fake number reads as 0
        assert live.live > 0
    after = (torch.Tensor.item, torch.allclose, transformers.AutoModelForCausalLM.from_pretrained,
             actor.to_tensors, TrainEngine.micro_batches)
    assert after == before
    assert torch.ones(2).sum().item() == 2.0
