"""SGLang's penalties and logit_bias on the CPU server: each token's logprob is that of the distribution
it was drawn from, checked against a direct computation (a forward pass, bias and penalties from the
output so far, log_softmax)."""

from __future__ import annotations

from pathlib import Path

import torch

from services.inference.model_backend import TransformersBackend
from services.inference.requests import Joining, SamplingParams


def test_penalties_and_logit_bias_are_applied_and_their_logprobs_are_the_sampled_distributions(tiny_model: Path) -> None:
    backend = TransformersBackend(str(tiny_model), tokenizer=False)
    prompt = [1, 5, 6, 7]
    params = SamplingParams(max_new_tokens=12, seed=4, temperature=0.8, frequency_penalty=1.5, presence_penalty=0.5,
                            logit_bias=((9, 3.0), (10, -100.0)))
    out, _ = backend.step(set(), [Joining(1, prompt, params)])
    got = [(out[0][1], out[0][2])]
    while len(got) < 12:
        out, _ = backend.step(set(), [])
        got.append((out[0][1], out[0][2]))
    tokens = [t for t, _ in got]
    assert 10 not in tokens
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    counts = torch.zeros(logits.shape[-1])
    for i, (tok, lp) in enumerate(got):
        row = logits[i].clone()
        row[9] += 3.0
        row[10] -= 100.0
        row -= 1.5 * counts + 0.5 * (counts > 0).float()
        assert abs(float(torch.log_softmax(row / 0.8, dim=-1)[tok]) - lp) < 1e-4, i
        counts[tok] += 1
