"""Parse and validate a `/generate` body into prompts and sampling parameters.

Everything wrong with a request is found here, before it reaches the decode loop, and becomes SGLang's
error shape (HTTP 400 `{"error": {"message": ...}}`) with a message that names the field.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.inference.grammar import FIELDS as GRAMMAR_FIELDS
from services.inference.grammar import GrammarError, GrammarSpec, parse_grammar


class RequestError(ValueError):
    """A request the server will not run (HTTP 400)."""

MAX_TOP_LOGPROBS = 20
"""The most `top_logprobs_num` the CPU server computes (OpenAI's own limit for `top_logprobs`)."""

# Known SGLang sampling params this server accepts only at their neutral value.
_NEUTRAL = {"repetition_penalty": 1.0, "min_p": 0.0}
_IGNORED = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval"}
_TOP_IGNORED = {"logprob_start_len", "return_text_in_logprobs", "custom_logit_processor", "modalities",
                "image_data", "session_params", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                "data_parallel_rank", "log_metrics", "return_hidden_states", "priority"}


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    top_logprobs_num: int = 0
    """How many most likely tokens to report per output position (a top-level request field in SGLang,
    carried here so the decode loop sees it); 0 unless `return_logprob` is set."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it is already in the output (penalties.py)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits (SGLang's `logit_bias`, keys as strings there)."""
    grammar: GrammarSpec | None = None
    """The output constraint (`json_schema`, `regex` or `ebnf`), enforced while decoding (grammar.py)."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1


@dataclass
class Joining:
    """What the scheduler hands a backend when a sequence joins the batch."""

    sid: int
    prompt: list[int]
    params: SamplingParams


@dataclass
class GenerateInput:
    prompts: list[list[int]]
    """One prompt per output (a batch input and `n` > 1 expand here)."""
    batched: bool
    """Answer with a JSON list (batch input or n > 1)."""
    param_list: list[SamplingParams]
    """Each prompt's sampling parameters (a batch may give one object for all or one per input)."""
    return_logprobs: list[bool]
    """Each prompt's `return_logprob` (a batch may give one flag for all or one per input)."""
    stream: bool = False
    rids: list[str] = field(default_factory=list)

    @property
    def params(self) -> SamplingParams:
        """The first prompt's parameters (all of them, for a single request)."""
        return self.param_list[0]

    @property
    def return_logprob(self) -> bool:
        return self.return_logprobs[0]


def _int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise RequestError(f"{name} must be an integer, got {v!r}")
    return v


def _float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(f"{name} must be a number, got {v!r}")
    return float(v)


_KNOWN = ((set(SamplingParams.__dataclass_fields__) - {"seed", "top_logprobs_num", "grammar"}) | {"sampling_seed", "n"}
          | set(_NEUTRAL) | _IGNORED | set(GRAMMAR_FIELDS))
"""Every `sampling_params` field the server knows (computed once: a batch parses one object per input)."""


def parse_sampling(raw: Any, top_logprobs_num: int = 0) -> SamplingParams:
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}")
    try:
        key = tuple(sorted(raw.items()))
        hash(key)
    except TypeError:  # a list value (stop, stop_token_ids): parsed each time
        return _parse_sampling(raw, top_logprobs_num)
    return _parse_cached(key, top_logprobs_num)


@functools.lru_cache(maxsize=4096)
def _parse_cached(key: tuple[tuple[str, Any], ...], top_logprobs_num: int) -> SamplingParams:
    """Every pass of a run sends the same few sampling settings: parse each once (the result is frozen)."""
    return _parse_sampling(dict(key), top_logprobs_num)


def _parse_sampling(raw: dict[str, Any], top_logprobs_num: int) -> SamplingParams:
    if not _KNOWN.issuperset(raw):
        raise RequestError(f"sampling_params: unknown field(s) {', '.join(sorted(set(raw) - _KNOWN))}")
    for name in _NEUTRAL.keys() & raw.keys():
        if raw[name] not in (None, _NEUTRAL[name]):
            raise RequestError(f"sampling_params.{name}={raw[name]!r} is not supported by the CPU server")
    max_new = _int("max_new_tokens", raw.get("max_new_tokens", 128))
    if max_new < 0:
        raise RequestError(f"max_new_tokens must be >= 0, got {max_new}")
    temperature = _float("temperature", raw.get("temperature", 1.0))
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    top_p = _float("top_p", raw.get("top_p", 1.0))
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    top_k = _int("top_k", raw.get("top_k", -1))
    if top_k == 0 or top_k < -1:
        raise RequestError(f"top_k must be -1 (all) or >= 1, got {top_k}")
    stop = raw.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a string or a list of non-empty strings, got {raw.get('stop')!r}")
    stop_ids = raw.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise RequestError(f"stop_token_ids must be a list of integers, got {stop_ids!r}")
    seed = raw.get("sampling_seed")
    penalty = {}
    for name in ("frequency_penalty", "presence_penalty"):
        penalty[name] = _float(name, raw.get(name) or 0.0)
        if not -2.0 <= penalty[name] <= 2.0:  # SGLang's own check, word for word
            raise RequestError(f"{name} must be in [-2, 2], got {penalty[name]}.")
    bias = raw.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must be an object of token id -> bias, got {bias!r}")
    try:
        logit_bias = tuple(sorted((int(k), _float("logit_bias[]", v)) for k, v in bias.items()))
    except ValueError as exc:
        raise RequestError(f"logit_bias keys must be token ids: {exc}") from exc
    try:
        grammar = parse_grammar(raw)
    except GrammarError as exc:
        raise RequestError(str(exc)) from exc
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=tuple(stop),
        stop_token_ids=frozenset(_int("stop_token_ids[]", t) for t in stop_ids),
        ignore_eos=bool(raw.get("ignore_eos", False)),
        min_new_tokens=_int("min_new_tokens", raw.get("min_new_tokens", 0)),
        seed=None if seed is None else _int("sampling_seed", seed),
        skip_special_tokens=bool(raw.get("skip_special_tokens", True)),
        no_stop_trim=bool(raw.get("no_stop_trim", False)),
        top_logprobs_num=top_logprobs_num,
        frequency_penalty=penalty["frequency_penalty"],
        presence_penalty=penalty["presence_penalty"],
        logit_bias=logit_bias,
        grammar=grammar,
    )


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int))


def _per_input(raw: Any, count: int, batched: bool, name: str, valid: Callable[[Any], bool]) -> list[Any]:
    """A field a batch may give once for all inputs or as a list of one value per input (SGLang's
    batch normalization); a single request takes one value."""
    if isinstance(raw, list):
        if not batched:
            raise RequestError(f"{name} is a list, but the request is not a batch (input_ids is one prompt)")
        if len(raw) != count:
            raise RequestError(f"{name} has {len(raw)} entries for a batch of {count} inputs")
        values = raw
    else:
        values = [raw] * count
    for i, v in enumerate(values):
        if not valid(v):
            where = f"{name}[{i}]" if isinstance(raw, list) else name
            raise RequestError(f"{where} has the wrong type: {type(v).__name__}")
    return values


def parse_generate(
    body: Any,
    *,
    vocab_size: int,
    context_length: int,
    tokenize: Callable[[str], list[int]] | None,
) -> GenerateInput:
    """Validate a `/generate` body; raise RequestError naming the problem."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    allowed = {"text", "input_ids", "sampling_params", "return_logprob", "top_logprobs_num", "stream", "rid",
               "lora_path", "input_embeds"} | _TOP_IGNORED
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}")
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise RequestError("Either text or input_ids should be provided (exactly one of them).")
    if body.get("input_embeds") is not None or body.get("lora_path") is not None:
        raise RequestError("input_embeds and lora_path are not supported by the CPU server")
    if has_text:
        if tokenize is None:
            raise RequestError("text input needs a tokenizer; this server has none: send input_ids")
        texts = body["text"]
        batched = isinstance(texts, list)
        texts = texts if batched else [texts]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a non-empty list of strings")
        prompts = [tokenize(t) for t in texts]
    else:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        batched = isinstance(ids[0], list)
        prompts = [list(p) for p in ids] if batched else [ids]
    if body.get("logprob_start_len") not in (None, -1) and not (
        isinstance(body.get("logprob_start_len"), list) and all(v in (None, -1) for v in body["logprob_start_len"])
    ):
        raise RequestError("input logprobs (logprob_start_len >= 0) are not supported by the CPU server")
    count = len(prompts)
    samplings = _per_input(body.get("sampling_params"), count, batched, "sampling_params", lambda v: isinstance(v, dict) or v is None)
    flags = [bool(f) for f in _per_input(body.get("return_logprob", False), count, batched, "return_logprob", _scalar)]
    raw_tops = _per_input(body.get("top_logprobs_num", 0), count, batched, "top_logprobs_num", _scalar)
    tops = [_int("top_logprobs_num", t or 0) for t in raw_tops]
    for top_n in tops:
        if not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs_num must be in 0..{MAX_TOP_LOGPROBS} on the CPU server, got {top_n}")
    ns = {_int("n", (raw or {}).get("n", 1)) for raw in samplings}
    if len(ns) > 1:  # SGLang's own check, word for word
        raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
    n = ns.pop()
    if n < 1:
        raise RequestError(f"n must be >= 1, got {n}")
    # as in SGLang, top log-probs come only with `return_logprob`
    params = [parse_sampling(raw, top if flag else 0) for raw, flag, top in zip(samplings, flags, tops, strict=True)]

    for i, prompt in enumerate(prompts):
        where = f"input_ids[{i}]" if batched else "input_ids"
        if not prompt:
            raise RequestError(f"{where} is empty")
        if not (all(type(tok) is int for tok in prompt) and 0 <= min(prompt) and max(prompt) < vocab_size):
            for tok in prompt:  # name the first bad one
                if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
                    raise RequestError(f"{where}: token id {tok!r} is out of vocabulary (vocab size {vocab_size})")
        for token, _ in params[i].logit_bias:  # SGLang's own check, word for word
            if not 0 <= token < vocab_size:
                raise RequestError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token}.")
        # SGLang's TokenizerManager._validate_one_request, word for word: an input as long as the context
        # is refused whatever max_new_tokens asks; then prompt + max_new_tokens must fit
        if len(prompt) >= context_length:
            raise RequestError(f"The input ({len(prompt)} tokens) is longer than the model's context length ({context_length} tokens).")
        total = len(prompt) + params[i].max_new_tokens
        if total > context_length:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {context_length} tokens. You "
                f"requested a total of {total} tokens: {len(prompt)} tokens from the input messages and "
                f"{params[i].max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
            )
    rid = body.get("rid")
    expanded = [p for p in prompts for _ in range(n)]
    if isinstance(rid, list):
        rids = [str(r) for r in rid]
        if len(rids) != len(prompts):
            raise RequestError(f"rid has {len(rids)} entries for {len(prompts)} inputs")
        rids = [f"{r}-{k}" if n > 1 else r for r in rids for k in range(n)]
    elif rid is not None:  # SGLang names a batch's requests `<rid>_<i>`
        rids = [str(rid)] if not (batched or n > 1) else [f"{rid}_{i}" for i in range(len(expanded))]
    else:
        rids = []
    if len(set(rids)) != len(rids):  # SGLang's own check, word for word
        duplicates = sorted({r for r in rids if rids.count(r) > 1})
        raise RequestError(f"Duplicate request IDs detected within the request: {duplicates}")
    return GenerateInput(
        prompts=expanded,
        batched=batched or n > 1,
        param_list=[p for p in params for _ in range(n)],
        return_logprobs=[f for f in flags for _ in range(n)],
        stream=bool(body.get("stream", False)),
        rids=rids,
    )
