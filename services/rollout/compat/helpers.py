"""AReaL's small helpers its workflows call: `import_from_string` (`areal.utils.dynamic_import`),
`apply_chat_template` and `load_hf_tokenizer` (`areal.utils.hf_utils`)."""

from __future__ import annotations

from typing import Any

from services.common.refs import resolve_ref


def import_from_string(path: str) -> Any:
    """The object `path` names: AReaL's dotted `"pkg.mod.name"`, or `"pkg.mod:name"`, or
    `"file.py:name"` (`services.common.refs`); an ImportError naming what is missing otherwise."""
    return resolve_ref(path)


def apply_chat_template(tokenizer: Any, messages: Any, *, tokenize: bool = True, add_generation_prompt: bool = False,
                        enable_thinking: bool | None = None, **kwargs: Any) -> Any:
    """`tokenizer.apply_chat_template(messages, ...)` returning a list of ids when `tokenize` (the
    `BatchEncoding` of transformers 5 is unwrapped, as AReaL's workflows index into a list);
    `enable_thinking` reaches the template only when given (templates without it ignore it anyway)."""
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    out = tokenizer.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs)
    if tokenize and hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if tokenize and hasattr(out, "tolist"):
        out = out.tolist()
    return out


def load_hf_tokenizer(path: str, fast_tokenizer: bool = True, padding_side: str | None = None) -> Any:
    """A model directory's tokenizer, loaded as the rollout worker loads it."""
    from services.rollout.tokenizer import load_pretrained_tokenizer

    tok = load_pretrained_tokenizer(path)
    if padding_side is not None:
        tok.padding_side = padding_side
    return tok
