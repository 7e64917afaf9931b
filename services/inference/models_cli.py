"""`jetrl models`: the models `jetrl make-model` makes, and whether this machine has each yet."""

from __future__ import annotations

import argparse

from services.common.model_path import KNOWN_MODELS, cache_root, known_model_dir


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="jetrl models", description=__doc__).parse_args(argv)
    print("jetrl make-model NAME makes these; model_path: NAME then finds the made directory")
    print(f"  {'tiny':<24} random 2-layer Llama, char tokenizer (the default; --out, default .jetrl/models/tiny)")
    for name, model in KNOWN_MODELS.items():
        made = known_model_dir(name)
        state = f"made: {made}" if (made / "config.json").is_file() else "not made yet"
        print(f"  {name:<24} {model.about}\n  {'':<24} {state}")
    print(f"cache: {cache_root()} ($JETRL_CACHE moves it)")
    print("model_path also takes any HF model directory, or a hub id already in the local Hugging Face cache")
    return 0
