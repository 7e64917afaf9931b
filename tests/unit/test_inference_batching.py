"""The CPU server's batching: newcomers prefilled inside the decode call, and a group's identical
prompts prefilled once, give every request the tokens and logprobs it gets alone; the call-cost fit
that decides merging; batched uniform draws; no tokenizer loaded for a `skip_tokenizer_init` server."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.inference.cost import CallCost
from services.inference.model_backend import TransformersBackend
from services.inference.requests import Joining, SamplingParams
from services.inference.sampling import sample_top


class _Merge(CallCost):
    """A cost model that always (or never) prefers the merged call."""

    def __init__(self, merge: bool) -> None:
        super().__init__()
        self.merge = merge

    def worth_merging(self, padded_rows: int) -> bool:
        return self.merge


PROMPTS = {0: [1, 6, 7, 8, 16], 1: [1, 9, 9, 9, 16], 2: [1, 5, 5, 5, 16], 3: [1, 6, 6, 6, 16], 4: [1, 7, 7, 7, 16],
           5: [1, 8, 8, 8, 16], 6: [1, 2, 3], 7: [1, 9, 8, 7, 6, 5, 16]}
"""Two prompt lengths besides the common one: those are prefilled on their own even when merging."""


Outputs = dict[int, list[tuple[int, float]]]


def _run(backend: TransformersBackend, arrivals: list[list[int]], leaving: dict[int, set[int]], steps: int) -> Outputs:
    """Step the backend: at step i the sids of `arrivals[i]` join and `leaving[i]` leave; every request
    is seeded, so its tokens are its own whatever the batch."""
    got: Outputs = {}
    for i in range(steps):
        sids = arrivals[i] if i < len(arrivals) else []
        joining = [Joining(sid, PROMPTS[sid], SamplingParams(max_new_tokens=64, seed=100 + sid)) for sid in sids]
        out, _ = backend.step(leaving.get(i, set()), joining)
        for sid, tok, lp, _top in out:
            got.setdefault(sid, []).append((tok, lp))
    return got


def test_newcomers_prefilled_in_the_decode_call_get_the_tokens_they_get_alone(tiny_model: Path) -> None:
    arrivals = [[0], [1, 2, 6], [], [3, 7], [4, 5], [], []]
    leaving = {3: {1}, 5: {0, 6}}  # rows leave in the middle of the batch: their columns go with them
    batched = TransformersBackend(str(tiny_model), tokenizer=False)
    batched.cost = _Merge(True)
    got = _run(batched, arrivals, leaving, steps=9)
    assert sum(batched.forward_rows["decode+prefill"].values()) >= 3  # the merged call did run
    assert batched.forward_rows["prefill"]  # the odd lengths went on their own
    for sid in PROMPTS:
        alone = TransformersBackend(str(tiny_model), tokenizer=False)
        alone.cost = _Merge(False)
        start = next(i for i, a in enumerate(arrivals) if sid in a)
        ref = _run(alone, [[sid]], {}, steps=len(got[sid]))[sid]
        assert [t for t, _ in got[sid]] == [t for t, _ in ref], f"request {sid} (joined at step {start})"
        assert max(abs(a - b) for (_, a), (_, b) in zip(got[sid], ref, strict=True)) < 1e-5


def test_a_groups_identical_prompts_run_once_and_each_request_samples_its_own(tiny_model: Path) -> None:
    """A group's samples (one prompt, n completions) are prefilled as one row, on their own or inside
    the decode call; every request still gets the tokens and logprobs it gets alone."""
    first, second = [1, 6, 7, 8, 16], [1, 9, 9, 9, 16]
    params = {sid: SamplingParams(max_new_tokens=64, seed=100 + sid) for sid in range(16)}
    batched = TransformersBackend(str(tiny_model), tokenizer=False)
    batched.cost = _Merge(True)
    got: Outputs = {}
    for i in range(5):
        joining = ([Joining(sid, first, params[sid]) for sid in range(8)] if i == 0
                   else [Joining(sid, second, params[sid]) for sid in range(8, 16)] if i == 1 else [])
        for sid, tok, lp, _top in batched.step(set(), joining)[0]:
            got.setdefault(sid, []).append((tok, lp))
    assert dict(batched.forward_rows["prefill"]) == {1: 1}  # eight requests, one prompt row
    assert dict(batched.forward_rows["decode+prefill"]) == {8 + 1: 1}  # eight running rows and one prompt row
    assert len({tuple(t for t, _ in got[sid]) for sid in range(8)}) > 1  # the copies sampled apart
    for sid in range(16):
        alone = TransformersBackend(str(tiny_model), tokenizer=False)
        ref: list[tuple[int, float]] = []
        for i in range(len(got[sid])):
            joining = [Joining(sid, first if sid < 8 else second, params[sid])] if i == 0 else []
            ref += [(tok, lp) for _, tok, lp, _top in alone.step(set(), joining)[0]]
        assert [t for t, _ in got[sid]] == [t for t, _ in ref], f"request {sid}"
        assert max(abs(a - b) for (_, a), (_, b) in zip(got[sid], ref, strict=True)) < 1e-5


def test_removed_rows_take_their_cache_columns_with_them(tiny_model: Path) -> None:
    backend = TransformersBackend(str(tiny_model), tokenizer=False)
    backend.cost = _Merge(True)
    _run(backend, [[0], [1, 2]], {}, steps=3)
    wide = backend._mask.shape[1]
    backend.remove({0})  # the rows that joined later hold the newest columns only
    assert backend._mask.shape[1] < wide and bool(backend._mask.any(dim=0).all())
    assert all(k.shape[2] == backend._mask.shape[1] for k in backend._keys)


def test_the_call_cost_fit_decides_merging() -> None:
    cost = CallCost(min_calls=10)
    assert not cost.worth_merging(1)  # nothing observed: never merge
    for rows in [8, 16, 64, 256] * 5:
        cost.observe(rows, 0.001 + 1e-5 * rows)  # 1 ms a call, 10 us a row
    fixed, per_row = cost.fit() or (0.0, 0.0)
    assert fixed == pytest.approx(0.001, rel=1e-3) and per_row == pytest.approx(1e-5, rel=1e-3)
    assert cost.worth_merging(50) and not cost.worth_merging(200)
    same = CallCost(min_calls=1)
    for _ in range(30):
        same.observe(8, 0.001)  # one batch size only: no slope to go on
    assert same.fit() is None


def test_shared_generator_rows_draw_together_and_seeded_rows_stay_their_own() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 48)
    params = [SamplingParams(temperature=1.0)] * 6
    shared = torch.Generator().manual_seed(1)
    gens = [shared, torch.Generator().manual_seed(7), shared, shared, torch.Generator().manual_seed(9), shared]
    tokens, logps, _ = sample_top(logits, params, gens)
    for row, seed in ((1, 7), (4, 9)):
        alone, alone_lp, _ = sample_top(logits[row:row + 1], params[:1], [torch.Generator().manual_seed(seed)])
        assert tokens[row] == alone[0] and logps[row] == pytest.approx(alone_lp[0])
    fresh = torch.Generator().manual_seed(1)
    seeded = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(9)]
    again, _, _ = sample_top(logits, params, [fresh, seeded[0], fresh, fresh, seeded[1], fresh])
    assert again == tokens  # one draw call for the shared rows: reproducible from the server's seed


def test_skip_tokenizer_init_loads_no_tokenizer_but_reports_its_path(tiny_model: Path) -> None:
    backend = TransformersBackend(str(tiny_model), tokenizer=False)
    assert backend.tokenizer is None and backend.decode_text([5, 6]) is None
    assert backend.tokenizer_path == str(tiny_model)  # as SGLang reports it: clients load it for stop strings
    assert TransformersBackend(str(tiny_model)).tokenizer is not None
