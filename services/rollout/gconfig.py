"""`GenerationHyperparameters`: AReaL's sampling settings, as workflows pass them in `ModelRequest(gconfig=...)`.

Same field names and defaults as AReaL (`top_k=100000000` means no limit: the inference server caps it
at the vocabulary). One request asks for one completion: `n_samples` is how many times a workflow
calls `agenerate` (AReaL's `gconfig.new(n_samples=1)` idiom), so a request with `n_samples != 1` is
refused, as AReaL refuses it. Settings the inference servers cannot honour are refused when not at
their default, never silently ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

#: fields jetrl's inference servers do not implement: only their default value is accepted
_UNSUPPORTED: dict[str, Any] = {"lora_name": "", "use_beam_search": False, "min_new_tokens": 0}


#: where `max_new_tokens` goes in each OpenAI-style API
_OPENAI_MAX_NEW_TOKENS = {"completions": "max_completion_tokens", "responses": "max_output_tokens", "openai-agents": "max_tokens"}
#: settings with no OpenAI argument (`max_tokens` caps prompt + completion, which OpenAI has no name for)
_OPENAI_UNSUPPORTED = {"min_new_tokens", "greedy", "top_k", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                       "lora_name", "use_beam_search", "max_tokens", "json_schema", "regex", "ebnf"}


def _log() -> Any:
    from services.common.logging import get_logger

    return get_logger("rollout")


@dataclass
class GenerationHyperparameters:
    n_samples: int = 1
    """Completions a workflow samples per prompt (it calls `agenerate` this many times)."""
    max_new_tokens: int = 16384
    """Longest completion."""
    min_new_tokens: int = 0
    """Only 0 is supported."""
    max_tokens: int = 65536
    """Longest prompt + completion: the completion budget is cut to `max_tokens - len(input_ids)`."""
    greedy: bool = False
    """Take the most likely token (temperature 0)."""
    top_p: float = 1.0
    top_k: int = 100_000_000
    temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the completion (besides EOS)."""
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    """For decoding text only; token ids are never affected."""
    stop: list[str] | None = None
    """Strings that end the completion."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it is already in the completion (SGLang's)."""
    json_schema: str | None = None
    """Output constrained to JSON valid against this schema (JSON text), enforced while decoding."""
    regex: str | None = None
    """Output constrained to this regular expression."""
    ebnf: str | None = None
    """Output constrained to this EBNF grammar (xgrammar's dialect, as SGLang)."""
    lora_name: str = ""
    """Only "" is supported."""
    use_beam_search: bool = False
    """Only False is supported."""

    def new(self, **kwargs: Any) -> GenerationHyperparameters:
        """A copy with `kwargs` changed (AReaL's `gconfig.new(n_samples=1)`)."""
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"GenerationHyperparameters has no field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **kwargs)

    def new_with_stop_and_pad_token_ids(self, tokenizer: Any) -> GenerationHyperparameters:
        """A copy that also stops at the tokenizer's pad and EOS tokens (added to `stop_token_ids`
        once each, in that order, when the tokenizer has them), as AReaL's workflows call it."""
        stops = list(self.stop_token_ids)
        for token in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
            if token is not None and token not in stops:
                stops.append(token)
        return self.new(stop_token_ids=stops)

    def to_openai_args_dict(self, exclude_args: list[str] | None = None, api_format: str = "completions") -> dict[str, Any]:
        """These settings as an OpenAI client's keyword arguments: `n_samples` is `n`, `max_new_tokens`
        is `max_completion_tokens` ("completions"), `max_output_tokens` ("responses") or `max_tokens`
        ("openai-agents"); fields OpenAI has no argument for are left out (logged when not at their
        default, since they then change nothing), as are `exclude_args`."""
        target = _OPENAI_MAX_NEW_TOKENS.get(api_format)
        if target is None:
            raise ValueError(f"api_format {api_format!r}: expected one of {sorted(_OPENAI_MAX_NEW_TOKENS)}")
        skip = set(exclude_args or ()) | _OPENAI_UNSUPPORTED
        defaults = GenerationHyperparameters()
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in skip:
                if f.name in _OPENAI_UNSUPPORTED and value != getattr(defaults, f.name):
                    _log().warning("generation setting has no OpenAI argument; left out", setting=f.name, value=value)
                continue
            out[{"n_samples": "n", "max_new_tokens": target}.get(f.name, f.name)] = value
        return out

    def to_openai_completions_args_dict(self, exclude_args: list[str] | None = None) -> dict[str, Any]:
        return self.to_openai_args_dict(exclude_args, "completions")

    def to_openai_responses_args_dict(self, exclude_args: list[str] | None = None) -> dict[str, Any]:
        return self.to_openai_args_dict(exclude_args, "responses")

    def to_openai_agents_model_settings_dict(self, exclude_args: list[str] | None = None) -> dict[str, Any]:
        return self.to_openai_args_dict(exclude_args, "openai-agents")

    def check(self) -> None:
        """Raise ValueError naming the first setting a request cannot carry."""
        if self.n_samples != 1:
            raise ValueError(
                f"gconfig.n_samples={self.n_samples}: one request generates one completion; "
                "call agenerate n_samples times with gconfig.new(n_samples=1)"
            )
        for name, default in _UNSUPPORTED.items():
            if getattr(self, name) != default:
                raise ValueError(f"gconfig.{name}={getattr(self, name)!r} is not supported by jetrl's inference servers")
        if self.max_new_tokens < 0:
            raise ValueError(f"gconfig.max_new_tokens must be >= 0, got {self.max_new_tokens}")

    def sampling(self, prompt_len: int) -> dict[str, Any]:
        """The flat `ModelRequest` fields these settings mean for a prompt of `prompt_len` tokens."""
        self.check()
        return {
            "max_new_tokens": max(0, min(self.max_new_tokens, self.max_tokens - prompt_len)),
            "temperature": 0.0 if self.greedy else self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": list(self.stop_token_ids),
            "stop": list(self.stop or []),
            "ignore_eos": self.ignore_eos,
            "frequency_penalty": self.frequency_penalty,
            "json_schema": self.json_schema,
            "regex": self.regex,
            "ebnf": self.ebnf,
        }
