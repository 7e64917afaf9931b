"""Structured output while decoding: SGLang's `json_schema`, `regex` and `ebnf` sampling params,
enforced as SGLang's default grammar backend does, with xgrammar.

Each constrained request gets its own `GrammarMatcher`. Every step, the rows that carry one get a token
bitmask (the tokens that keep the output a prefix of the grammar's language) and every other token's
logit is set to -inf before temperature, top-k and top-p; the sampled token is then fed to the matcher.
Once the grammar is complete only the stop tokens (EOS) are allowed, so a constrained output ends with
EOS. The logprob reported for a token is the one of the distribution it was drawn from: the masked and
renormalised one (docs/inference.md, "Structured output").

As in SGLang: at most one of `json_schema`, `regex`, `ebnf`, `structural_tag` per request; an empty
string means unset; JSON schemas compile with `any_whitespace` and `strict_mode` (xgrammar's defaults,
SGLang's too); a grammar that does not compile is a 400 naming it; a server without a tokenizer
(`skip_tokenizer_init`, as SGLang's `--skip-tokenizer-init`) has no grammar backend and refuses them
with SGLang's message.
Compiled grammars are cached by their text.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
"""The `sampling_params` fields that constrain the output (SGLang's names)."""


class GrammarError(ValueError):
    """A constraint the server cannot compile or does not support (HTTP 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    """"json", "regex" or "ebnf" (SGLang's grammar key names)."""
    text: str


def parse_grammar(raw: dict[str, Any]) -> GrammarSpec | None:
    """The constraint a `sampling_params` object carries, or None. Raises GrammarError."""
    given = [name for name in FIELDS if raw.get(name) not in (None, "")]
    if len(given) > 1:  # SGLang's own check, word for word
        raise GrammarError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    if not given:
        return None
    name = given[0]
    text = raw[name]
    if not isinstance(text, str):
        raise GrammarError(f"sampling_params.{name} must be a string, got {type(text).__name__}")
    if name == "structural_tag":
        raise GrammarError("sampling_params.structural_tag is not supported by the CPU server; use json_schema, regex or ebnf")
    return GrammarSpec("json" if name == "json_schema" else name, text)


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_ids: set[int]) -> Any:
    """xgrammar's view of the vocabulary: each id's text, special tokens blanked (never allowed inside
    structured text; xgrammar treats an empty token as special) and the model's EOS ids as the stop
    tokens. `vocab_size` is the model's (its logits' width), which may exceed the tokenizer's."""
    import xgrammar as xgr

    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    encoded = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if 0 <= index < vocab_size:
            encoded[index] = token
    for index in tokenizer.all_special_ids:
        if 0 <= index < vocab_size:
            encoded[index] = ""
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids),
                             add_prefix_space=detected.add_prefix_space)


class Grammars:
    """Compiles constraints for one model's vocabulary (cached) and hands out matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int]) -> None:
        try:
            import xgrammar as xgr
        except ImportError as exc:  # the `grammar` extra: a request with a constraint says what to install
            raise GrammarError("structured output (json_schema / regex / ebnf) needs xgrammar on the server: "
                               "pip install 'jetrl[grammar]'") from exc

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, stop_ids), max_threads=1)
        self._compile = functools.lru_cache(maxsize=256)(self._compile_uncached)

    def _compile_uncached(self, spec: GrammarSpec) -> Any:
        try:
            if spec.kind == "json":
                return self.compiler.compile_json_schema(spec.text, any_whitespace=True)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.text)
            return self.compiler.compile_grammar(spec.text)
        except (RuntimeError, ValueError, TypeError) as exc:  # SGLang's wording: "Failed to compile json grammar: ..."
            raise GrammarError(f"Failed to compile {spec.kind} grammar: {exc}") from exc

    def check(self, spec: GrammarSpec) -> None:
        """Compile now (at parse time) so a bad grammar is the request's 400, not a failed step."""
        self._compile(spec)

    def matcher(self, spec: GrammarSpec) -> Any:
        return self.xgr.GrammarMatcher(self._compile(spec))


Matchers = list[Any]
"""One entry per batch row: its `GrammarMatcher`, or None for an unconstrained row."""


DEAD_END = ("the {kind} grammar admits no token of this model's vocabulary at this point of the output (the vocabulary "
            "cannot spell what the grammar requires next)")


def mask_logits(logits: torch.Tensor, matchers: Matchers | None) -> tuple[torch.Tensor, set[int]]:
    """`logits` [B, V] with every token a row's grammar forbids at -inf (in place; rows without a
    matcher untouched), and the rows whose grammar allows no token at all (a vocabulary that cannot
    spell what the grammar requires): those are left unmasked, their matcher not advanced; the caller
    ends them with an error."""
    if not matchers:
        return logits, set()
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits, set()
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    dead = {i for i in rows if not bool(bitmask[i].any())}
    live = [i for i in rows if i not in dead]
    if live:
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=live)
    return logits, dead


def advance(matchers: Matchers | None, tokens: list[int], dead: set[int]) -> None:
    """Feed each constrained row its sampled token (always one its mask allowed)."""
    for i, (matcher, token) in enumerate(zip(matchers or (), tokens, strict=False)):
        if matcher is not None and i not in dead and not matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")


SGLANG_NO_BACKEND = ("Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not supported when the server "
                     "is launched with --grammar-backend none")
"""SGLang's own abort message (`GrammarManager.process_req_with_grammar`) for a server with no grammar
backend, which is what `--skip-tokenizer-init` leaves it (the contract tier checks the wording)."""

NO_BACKEND = (f"{SGLANG_NO_BACKEND}: this server runs with skip_tokenizer_init=True, which leaves it no grammar backend "
              "(as SGLang's --skip-tokenizer-init does), or serves no model (simulate); start it with "
              "skip_tokenizer_init=false (jetrl up does for agent workflows: docs/inference.md, \"Structured output\")")


def check_grammars(specs: list[GrammarSpec | None], grammars: Grammars | None) -> None:
    """Refuse (GrammarError) the request's constraints this server cannot run, before it is queued."""
    wanted = {s for s in specs if s is not None}
    if not wanted:
        return
    if grammars is None:
        raise GrammarError(NO_BACKEND)
    for spec in wanted:
        grammars.check(spec)
