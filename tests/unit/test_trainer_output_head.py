"""Which models get the fused output projection: a plain tied Linear head does; ZeRO-3, logits
soft-capped after the projection (Gemma 2), and a head that is not a plain Linear fall back, each
with the reason the trainer logs."""

from __future__ import annotations

import torch

from services.trainer.model.fused_head import output_head


def _qwen2(**extra: object) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        intermediate_size=32, vocab_size=40, tie_word_embeddings=True, **extra))


def test_a_tied_linear_head_is_fused_and_zero3_falls_back() -> None:
    model = _qwen2()
    head, why = output_head(model, zero_stage=2)
    assert why is None and head is model.lm_head and head.weight is model.get_input_embeddings().weight
    head, why = output_head(model, zero_stage=3)
    assert head is None and why is not None and "ZeRO-3" in why


def test_soft_capped_logits_fall_back() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=8, intermediate_size=32, vocab_size=40, final_logit_softcapping=30.0))
    head, why = output_head(model, zero_stage=2)
    assert head is None and why is not None and "final_logit_softcapping=30.0" in why


def test_a_head_that_is_not_a_plain_linear_falls_back() -> None:
    model = _qwen2()

    class Scaled(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    head = Scaled(16, 40, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    got, why = output_head(model, zero_stage=2)
    assert got is None and why is not None and "Scaled" in why
