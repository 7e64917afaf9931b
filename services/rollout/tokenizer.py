"""The workflow's tokenizer, loaded without torch where that gives the same tokenizer.

`AutoTokenizer.from_pretrained` reads the model's config to choose the tokenizer class, and reading a
config imports torch (~2 CPU-s per worker start, on 2 cores beside a starting trainer and server). For
a model directory whose `tokenizer_config.json` names transformers' generic fast tokenizer
(`TokenizersBackend`, what transformers 5 writes for a tokenizer with no class of its own, and what
`jetrl make-model` writes) and whose model type transformers gives no tokenizer class of its own
(`GENERIC_MODEL_TYPES`), AutoTokenizer ends in `TokenizersBackend.from_pretrained(path)` anyway: that
is called directly. Anything else (a hub id, custom code, another class) goes through AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.common.model_path import require_model

#: model types for which AutoTokenizer loads a `TokenizersBackend` tokenizer_config as is: transformers
#: registers no tokenizer class of its own for them, or registers one but keeps the declared class
#: (the type is not in its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, as qwen2 is: there it loads its
#: Qwen2Tokenizer instead). tests/unit/test_rollout_tokenizer.py checks each against the installed
#: transformers, tests/integration/test_architectures.py loads a tiny model of each.
GENERIC_MODEL_TYPES = frozenset({"llama", "mistral", "qwen3", "gemma", "phi"})


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def generic_tokenizer_dir(model_path: str) -> bool:
    """True when `model_path` is a local model directory AutoTokenizer would load as a plain
    `TokenizersBackend` (see the module doc)."""
    root = Path(model_path)
    tok_config = _json(root / "tokenizer_config.json")
    config = _json(root / "config.json")
    if tok_config is None or config is None or not (root / "tokenizer.json").is_file():
        return False
    return (tok_config.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in tok_config
            and "auto_map" not in config and config.get("model_type") in GENERIC_MODEL_TYPES)


def load_pretrained_tokenizer(model_path: str) -> Any:
    """The tokenizer `AutoTokenizer.from_pretrained(model_path)` gives, without importing torch when
    the directory allows it."""
    model_path = require_model(model_path)  # a model name this machine does not have: says what to do
    if generic_tokenizer_dir(model_path):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
