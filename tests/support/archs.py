"""Tiny random models of architectures beyond Llama, built locally from their transformers config
classes (no download): Qwen2, Qwen3, Mistral, Gemma, Phi. Each gets the same locally trained
byte-level BPE tokenizer with a ChatML chat template, saved the way transformers 5 saves a tokenizer
with no class of its own (`TokenizersBackend`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["What is 12 + 7? The answer is 19.", "Give the final answer as a number at the end of your reply.",
          "user assistant system: you are a helpful model", "0 1 2 3 4 5 6 7 8 9 10 100 1000 plus minus equals"]
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 128}

ARCHS: dict[str, dict[str, Any]] = {
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "mistral": {"sliding_window": None},
    "gemma": {"head_dim": 8},
    "phi": {"num_key_value_heads": 4, "partial_rotary_factor": 0.5},
}
"""model_type -> what its tiny config needs besides `TINY`."""


def build_tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return fast


def build_arch_model(model_type: str, out: Path, seed: int = 0) -> Path:
    """A tiny random `model_type` model with the BPE tokenizer at `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer(out)
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, **{**TINY, **ARCHS[model_type]})
    config.dtype = "float32"
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out
