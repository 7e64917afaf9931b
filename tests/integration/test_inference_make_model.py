"""`jetrl make-model` builds the default tiny model locally, and it reloads as a normal HF directory."""

from __future__ import annotations

from pathlib import Path

from services.cli import main as cli_main


def test_make_model_builds_a_reloadable_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    assert cli_main(["make-model", "--out", str(out)]) == 0  # the `jetrl make-model` dispatch, in-process
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()

    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert config.model_type == "llama" and config.vocab_size == len(tok) == 48
    ids = tok("12 + 3=", add_special_tokens=False).input_ids
    assert len(ids) == 7 and tok.decode(ids) == "12 + 3="  # one token per character, spaces kept
    chat = tok.apply_chat_template([{"role": "user", "content": "123="}], add_generation_prompt=True, tokenize=False)
    assert chat == "<bos>123="

    # A second run keeps the existing model (no silent overwrite of weights someone trained).
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    from services.inference.make_model import build_model

    build_model(out, seed=5)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
