"""Memory of a train step: the tied embedding's lookup gradient is sparse (no dense vocabulary-sized
transient) with the gradients unchanged; untied embeddings keep their dense gradient; ZeRO's buckets
follow the model's size."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.trainer.model.engine import BUCKET_ELEMENTS_MAX, bucket_elements, ds_config, sparse_tied_lookup
from services.trainer.settings import TrainerSettings


def _model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=tied, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _backward(model: LlamaForCausalLM) -> tuple[dict[str, torch.Tensor], set[str]]:
    ids = torch.tensor([[5, 7, 7, 9, 0, 11], [3, 3, 8, 1, 2, 250]])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=ids).logits.float().log_softmax(-1).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, {e.name for e in prof.events()}


def test_tied_lookup_gradient_is_sparse_and_the_gradients_are_unchanged() -> None:
    dense_model = _model(tied=True)
    sparse_model = copy.deepcopy(dense_model)
    sparse_tied_lookup(sparse_model)
    dense, dense_ops = _backward(dense_model)
    sparse, sparse_ops = _backward(sparse_model)
    assert "aten::embedding_dense_backward" in dense_ops
    assert "aten::embedding_dense_backward" not in sparse_ops  # no (vocabulary x hidden) lookup gradient
    assert dense.keys() == sparse.keys()
    for name in dense:
        assert not sparse[name].is_sparse, name  # the parameter's gradient is dense, as ZeRO expects
        assert torch.allclose(sparse[name], dense[name], atol=1e-6), name


def test_untied_embeddings_keep_their_dense_gradient() -> None:
    model = _model(tied=False)
    sparse_tied_lookup(model)
    grads, ops = _backward(model)
    assert "aten::embedding_dense_backward" in ops
    assert not grads["model.embed_tokens.weight"].is_sparse


def test_zero_buckets_are_scaled_to_the_model() -> None:
    s = TrainerSettings(model_path="unused")
    zero = ds_config(s, 494_000_000)["zero_optimization"]  # a Qwen2-0.5B
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 494_000_000 // 16
    assert bucket_elements(100_000_000_000) == BUCKET_ELEMENTS_MAX
    assert bucket_elements(10_000) == 1_000_000
    assert "reduce_bucket_size" not in ds_config(s)["zero_optimization"]  # no size given: DeepSpeed's defaults
