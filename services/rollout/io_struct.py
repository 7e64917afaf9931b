"""What a rollout workflow sends to the inference engine and gets back (AReaL's `io_struct`):
`ModelRequest`, `ModelResponse`, `WeightUpdateMeta`, and the engine's errors. Plain data, no I/O;
`engine.py` re-exports them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from services.rollout.gconfig import GenerationHyperparameters


class InferenceError(Exception):
    """Generation failed."""


class BadRequestError(InferenceError):
    """The server refused the request (HTTP 400): the caller's bug, never retried."""


class ServersUnavailableError(InferenceError):
    """Every server failed (timeouts, connection errors, 5xx) after its retries."""


@dataclass
class ModelRequest:
    input_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    rid: str | None = None
    top_logprobs: int = 0
    """Also report this many most likely tokens per output position (SGLang's `top_logprobs_num`),
    in `ModelResponse.output_top_logprobs`; 0: none."""
    frequency_penalty: float = 0.0
    """SGLang's: subtracted from a token's logit once per time it is already in the output ([-2, 2])."""
    presence_penalty: float = 0.0
    """SGLang's: subtracted from the logit of every token already in the output ([-2, 2])."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> bias added to its logit (SGLang's `logit_bias`)."""
    json_schema: str | None = None
    """Constrain the output to JSON valid against this schema (JSON text), enforced while decoding
    (SGLang's `sampling_params.json_schema`). At most one of `json_schema`, `regex`, `ebnf`."""
    regex: str | None = None
    """Constrain the output to this regular expression (SGLang's `regex`)."""
    ebnf: str | None = None
    """Constrain the output to this EBNF grammar (SGLang's `ebnf`, xgrammar's dialect)."""
    gconfig: GenerationHyperparameters | None = None
    """AReaL's way to give the sampling settings; when set, its values replace the flat fields above."""
    tokenizer: Any = None
    """Carried for AReaL workflows that pass it; generation works on token ids and never uses it."""
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # what `apply_chat_template(tokenize=True)` returns under transformers 5 (a BatchEncoding) or a
        # tensor: AReaL workflows pass either straight through
        raw: Any = self.input_ids
        if isinstance(raw, Mapping) or hasattr(raw, "keys"):
            raw = raw["input_ids"]
        if hasattr(raw, "tolist"):
            raw = raw.tolist()
        elif not isinstance(raw, list):
            raw = list(raw)
        self.input_ids = raw
        if self.gconfig is not None:
            try:
                sampling = self.gconfig.sampling(len(self.input_ids))
            except ValueError as exc:  # a setting no retry can honour: the caller's bug
                raise BadRequestError(str(exc)) from exc
            for name, value in sampling.items():
                setattr(self, name, value)
        given = [name for name in ("json_schema", "regex", "ebnf") if getattr(self, name)]
        if len(given) > 1:  # SGLang refuses it too; said here, before any server is asked
            raise BadRequestError(f"ModelRequest sets {' and '.join(given)}: at most one output constraint per request")

    def extras(self) -> dict[str, Any]:
        """The output constraint, penalties and logit bias, as `build_generate_payload` takes them."""
        return {"json_schema": self.json_schema, "regex": self.regex, "ebnf": self.ebnf, "logit_bias": self.logit_bias,
                "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty}

    @property
    def constrained(self) -> bool:
        """Whether the output is held to a grammar (its state cannot be carried into a continuation)."""
        return bool(self.json_schema or self.regex or self.ebnf)


@dataclass
class ModelResponse:
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: str
    latency_s: float
    server: str
    passes: int = 1
    """How many `/generate` passes it took (more than 1 when aborts were continued)."""
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """With `ModelRequest.top_logprobs` > 0: per output token its most likely (token id, logprob), most
    likely first, from the distribution the token was drawn from; empty otherwise."""
    stop_matched: str | None = None
    """The stop string of the request that ended the output (`stop_reason` is then "stop"). The engine
    applies stop strings itself; `output_ids` end with the token that completed the match, so the
    decoded text still contains the stop string and the caller trims it for its API."""

    # AReaL's names for the same fields (aliases: reading or setting one is reading or setting the other)
    @property
    def input_tokens(self) -> list[int]:
        return self.input_ids

    @input_tokens.setter
    def input_tokens(self, value: list[int]) -> None:
        self.input_ids = value

    @property
    def output_tokens(self) -> list[int]:
        return self.output_ids

    @output_tokens.setter
    def output_tokens(self, value: list[int]) -> None:
        self.output_ids = value

    @property
    def latency(self) -> float:
        return self.latency_s

    @latency.setter
    def latency(self, value: float) -> None:
        self.latency_s = value

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)


@dataclass(frozen=True)
class WeightUpdateMeta:
    """What `InferenceEngine.update_weights` loads (AReaL-lite's names). Only the disk transport: an
    HF checkpoint directory every server can read; NCCL (docs/design.md "Weight sync") is not built."""

    path: str
    """HF checkpoint directory (config + safetensors) as the inference servers see it."""
    version: int
    """Weight version the servers report (and tag every new token with) once loaded."""
    type: Literal["disk"] = "disk"
