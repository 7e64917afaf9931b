"""The worker's tokenizer loader: AutoTokenizer's tokenizer, without torch for a generic tokenizer dir."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from services.rollout.tokenizer import GENERIC_MODEL_TYPES, generic_tokenizer_dir, load_pretrained_tokenizer
from services.rollout.workflows.common import encode_chat

ROOT = Path(__file__).resolve().parents[2]


def test_the_tiny_models_tokenizer_is_the_one_autotokenizer_gives(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    auto, ours = AutoTokenizer.from_pretrained(tiny_model), load_pretrained_tokenizer(str(tiny_model))
    assert generic_tokenizer_dir(str(tiny_model)) and type(ours) is type(auto)
    assert ours.all_special_ids == auto.all_special_ids and ours.eos_token_id == auto.eos_token_id
    for text in ("123=", "a longer prompt, with punctuation!"):
        ids = encode_chat(ours, text)
        assert ids == encode_chat(auto, text)
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)


def test_generic_model_types_keep_the_declared_tokenizer_class_in_transformers() -> None:
    from transformers.models.auto import tokenization_auto

    for model_type in GENERIC_MODEL_TYPES:
        registered = (tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend").removesuffix("Fast")
        # a class of its own replaces the declared one only for types transformers lists as declaring a wrong one
        assert registered in ("TokenizersBackend", "PreTrainedTokenizerFast") or (
            model_type not in tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS and registered != "MistralCommonBackend"
        ), model_type


def test_any_other_directory_goes_through_autotokenizer(tiny_model: Path, tmp_path: Path) -> None:
    for change in ({"model_type": "qwen2"}, {"auto_map": {"AutoConfig": "x.Y"}}):
        model = tmp_path / next(iter(change))
        shutil.copytree(tiny_model, model)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, **change}))
        assert not generic_tokenizer_dir(str(model))
    assert not generic_tokenizer_dir("org/some-hub-model")


def test_a_worker_with_the_rlvr_workflow_does_not_import_torch(tiny_model: Path) -> None:
    code = (
        "import sys\n"
        "from services.rollout.service import build_workflow, standard_kwargs\n"
        "from services.rollout.settings import RolloutSettings\n"
        "from services.rollout.tokenizer import load_pretrained_tokenizer\n"
        f"s = RolloutSettings(model_path={str(tiny_model)!r})\n"
        "build_workflow(s, standard_kwargs(s, lambda: load_pretrained_tokenizer(s.model_path), None))\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
