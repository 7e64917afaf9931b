"""`jetrl make-model`: build the default tiny model locally, with no download.

A character-level tokenizer (the `tokenizers` library, WordLevel over single characters) saved as a
transformers tokenizer with a chat template, and a small Llama-architecture causal LM from a config,
random init, saved with `save_pretrained`. Llama rather than Qwen2: with `model_type: qwen2`,
AutoTokenizer would force Qwen2's byte-level BPE and drop spaces (docs/reference/tiny-model-rl.md).
"""

from __future__ import annotations

import argparse
import string
import time
from collections.abc import Callable
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list(string.digits) + list("+-=*?:>") + [" "] + list(string.ascii_lowercase)
ASCII = [c for c in string.printable if c not in "\x0b\x0c\r"]
"""`--vocab ascii`: every printable ASCII character plus tab and newline (101 ids with the specials), so
the model can spell JSON, tool-call markup and code; the default `tiny` vocabulary cannot (no braces,
quotes, commas or brackets)."""
VOCABS = {"tiny": CHARS, "ascii": ASCII}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
)


def build_tokenizer(out_dir: Path, chars: list[str] = CHARS) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # one piece per character ("." leaves newlines out, which only the ascii vocabulary spells)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("." if chars is CHARS else "[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_model(
    out_dir: str | Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    ffn: int = 256,
    max_positions: int = 512,
    seed: int = 0,
    vocab: str = "tiny",
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write tokenizer + model to `out_dir` (skipped if a model is already there, unless `force`);
    `progress` is told each stage as it starts. `vocab` names the character set (`VOCABS`)."""
    if vocab not in VOCABS:
        raise ValueError(f"vocab must be one of {', '.join(VOCABS)}, got {vocab!r}")
    chars = VOCABS[vocab]
    say = progress or (lambda _: None)
    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "model.safetensors").exists() and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    out.mkdir(parents=True, exist_ok=True)
    say("writing the tokenizer")
    build_tokenizer(out, chars)
    config = LlamaConfig(
        vocab_size=len(SPECIALS) + len(chars),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.dtype = "float32"
    torch.manual_seed(seed)
    say(f"initialising a {layers}-layer model, hidden {hidden}")
    model = AutoModelForCausalLM.from_config(config)
    say(f"writing {sum(p.numel() for p in model.parameters()):,} parameters to {out}")
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jetrl make-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".jetrl/models/tiny", help="output directory")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--ffn", type=int, default=256, help="MLP intermediate size")
    parser.add_argument("--seed", type=int, default=0, help="init seed")
    parser.add_argument("--vocab", choices=sorted(VOCABS), default="tiny",
                        help="character set: tiny (digits, lowercase, + - = * ? : >) or ascii (all printable, for JSON and tool calls)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing model")
    args = parser.parse_args(argv)
    started = time.monotonic()

    def progress(stage: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {stage}", flush=True)

    out = build_model(args.out, hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, seed=args.seed,
                      vocab=args.vocab, force=args.force, progress=progress)
    print(f"model ready at {out} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
