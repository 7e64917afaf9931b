"""Structured output on the CPU server (services/inference/grammar.py): json_schema, regex and ebnf are
enforced while decoding in a batch with unconstrained rows, outputs end with EOS once the grammar is
complete, and the logprobs recorded are those of the constrained, renormalised distribution the token
was drawn from: checked against a direct computation (one forward pass, the grammar's mask,
log_softmax)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from services.inference.grammar import GrammarError, GrammarSpec, parse_grammar
from services.inference.model_backend import TransformersBackend
from services.inference.requests import Joining, RequestError, SamplingParams, parse_sampling

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["a", "b"]}}, "required": ["ok", "n", "tag"]}
SPECS = [GrammarSpec("json", json.dumps(SCHEMA)), GrammarSpec("regex", r"(yes|no) [0-9]{2}"),
         GrammarSpec("ebnf", 'root ::= "[" item ("," item)? "]"\nitem ::= [a-c]')]


def _generate(backend: TransformersBackend, prompt: list[int], params: dict[int, SamplingParams]) -> dict[int, list[tuple[int, float]]]:
    """Step the backend until every request ends (EOS or max_new_tokens); per sid its (token, logprob)s."""
    got: dict[int, list[tuple[int, float]]] = {sid: [] for sid in params}
    joining = [Joining(sid, prompt, p) for sid, p in params.items()]
    leaving: set[int] = set()
    live = set(params)
    while live:
        out, _ = backend.step(leaving, joining)
        joining, leaving = [], set()
        for sid, tok, lp, _top in out:
            got[sid].append((tok, lp))
            if tok in backend.eos_ids or len(got[sid]) >= params[sid].max_new_tokens:
                live.discard(sid)
                leaving.add(sid)
    return got


def _direct_logprobs(backend: TransformersBackend, prompt: list[int], tokens: list[int], spec: GrammarSpec | None,
                     temperature: float) -> list[float]:
    """Each token's logprob recomputed from scratch: one forward pass over prompt + output, the grammar's
    mask at each position (a fresh matcher fed the tokens before it), / temperature, log_softmax."""
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    matcher = backend.grammars.matcher(spec) if spec is not None else None  # type: ignore[union-attr]
    out = []
    for i, tok in enumerate(tokens):
        row = logits[i : i + 1].clone()
        if matcher is not None:
            import xgrammar as xgr

            mask = xgr.allocate_token_bitmask(1, row.shape[-1])
            matcher.fill_next_token_bitmask(mask, 0)
            xgr.apply_token_bitmask_inplace(row, mask)
            assert matcher.accept_token(tok)
        out.append(float(torch.log_softmax(row / temperature, dim=-1)[0, tok]))
    return out


def test_constraints_hold_in_a_mixed_batch_and_logprobs_are_the_constrained_distributions(ascii_model: Path) -> None:
    backend = TransformersBackend(str(ascii_model))
    tok = backend.tokenizer
    prompt = [1, *tok("answer:", add_special_tokens=False).input_ids]
    params = {sid: SamplingParams(max_new_tokens=400, seed=sid, temperature=0.9, grammar=SPECS[sid % 4] if sid % 4 < 3 else None)
              for sid in range(12)}
    got = _generate(backend, prompt, params)
    for sid, pairs in got.items():
        tokens = [t for t, _ in pairs]
        spec = params[sid].grammar
        if spec is None:
            continue
        assert tokens[-1] in backend.eos_ids, f"request {sid} ({spec.kind}) did not complete: {tok.decode(tokens)!r}"
        text = tok.decode(tokens, skip_special_tokens=True)
        if spec.kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif spec.kind == "regex":
            assert re.fullmatch(spec.text, text), text
        else:
            assert re.fullmatch(r"\[[a-c](,[a-c])?\]", text), text
        direct = _direct_logprobs(backend, prompt, tokens, spec, 0.9)
        assert max(abs(a - b) for (_, a), b in zip(pairs, direct, strict=True)) < 1e-4, f"request {sid}"
        assert pairs[-1][1] == pytest.approx(0.0, abs=1e-5)  # EOS was the only token the finished grammar allowed


def test_grammar_fields_are_checked_as_sglang_checks_them(ascii_model: Path) -> None:
    with pytest.raises(RequestError, match="Only one of json_schema, regex, ebnf, or structural_tag can be set"):
        parse_sampling({"json_schema": "{}", "regex": "a"})
    assert parse_sampling({"json_schema": "", "regex": None}).grammar is None  # empty means unset, as in SGLang
    with pytest.raises(RequestError, match="structural_tag is not supported"):
        parse_sampling({"structural_tag": "{}"})
    assert parse_grammar({"regex": "a+"}) == GrammarSpec("regex", "a+")
    backend = TransformersBackend(str(ascii_model))
    assert backend.grammars is not None
    with pytest.raises(GrammarError, match="Failed to compile json grammar"):
        backend.grammars.check(GrammarSpec("json", "{not json"))
    assert TransformersBackend(str(ascii_model), tokenizer=False).grammars is None


def test_a_completed_grammar_ends_the_output_with_ignore_eos(ascii_model: Path) -> None:
    """With ignore_eos no token ends an output (SGLang's rule), but a completed grammar does."""
    backend = TransformersBackend(str(ascii_model))
    params = SamplingParams(max_new_tokens=50, seed=3, ignore_eos=True, grammar=GrammarSpec("regex", "ab"))
    out, _ = backend.step(set(), [Joining(7, [1, 20], params)])
    tokens = [out[0][1]]
    while 7 not in backend.grammar_done:
        out, _ = backend.step(set(), [])
        tokens.append(out[0][1])
    assert backend.tokenizer.decode(tokens, skip_special_tokens=True) == "ab" and tokens[-1] in backend.eos_ids
