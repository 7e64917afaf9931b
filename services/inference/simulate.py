"""`simulate`: the same protocol with no model, for benchmarking the pipeline rather than CPU decoding.

A step costs `token_latency_s` whatever the batch size (as on a GPU, where decoding is memory-bound),
tokens are random, and each completion's length is drawn from a log-normal distribution, so a few
completions run much longer than the median, as in real RL rollouts. Same interface as
`TransformersBackend`.
"""

from __future__ import annotations

import math
import random
import time

from services.inference.requests import Joining
from services.inference.settings import SimulateSettings


class _SimRow:
    def __init__(self, sid: int, target: int, rng: random.Random) -> None:
        self.sid = sid
        self.target = target
        self.made = 0
        self.rng = rng


class SimulatedBackend:
    def __init__(self, sim: SimulateSettings, *, seed: int = 0, version: str = "0", context_length: int = 1 << 20) -> None:
        self.sim = sim
        self.version = version
        self.vocab_size = sim.vocab_size
        self.context_length = context_length
        self.eos_ids = {sim.eos_token_id}
        self.tokenizer = None
        self.tokenizer_path = None
        self.model_path = "(simulated)"
        self._rng = random.Random(seed)
        self._rows: list[_SimRow] = []

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    def _draw_length(self, rng: random.Random) -> int:
        mu = math.log(max(1.0, self.sim.median_new_tokens))
        return max(1, int(rng.lognormvariate(mu, self.sim.length_sigma)))

    def _token(self, row: _SimRow) -> tuple[int, int, float]:
        row.made += 1
        tok = self.sim.eos_token_id if row.made >= row.target else row.rng.randrange(3, self.vocab_size)
        return row.sid, tok, -row.rng.random() * 3.0

    def step(self, remove: set[int], joining: list[Joining]) -> tuple[list[tuple[int, int, float]], str]:
        """Drop `remove`, then one step: a token for every row, the first token of every joiner."""
        self.remove(remove)
        if not self._rows and not joining:
            return [], self.version
        time.sleep(self.sim.token_latency_s + (self.sim.prefill_latency_s if joining else 0.0))
        out = [self._token(r) for r in self._rows]
        return out + self._join(joining), self.version

    def _join(self, joining: list[Joining]) -> list[tuple[int, int, float]]:
        out = []
        for j in joining:
            rng = random.Random(j.params.seed) if j.params.seed is not None else self._rng
            row = _SimRow(j.sid, self._draw_length(rng), rng)
            self._rows.append(row)
            out.append(self._token(row))
        return out

    def prefill(self, joining: list[Joining]) -> tuple[list[tuple[int, int, float]], str]:
        time.sleep(self.sim.token_latency_s + self.sim.prefill_latency_s)
        return self._join(joining), self.version

    def decode(self) -> tuple[list[tuple[int, int, float]], str]:
        if not self._rows:
            return [], self.version
        time.sleep(self.sim.token_latency_s)
        return [self._token(r) for r in self._rows], self.version

    def remove(self, sids: set[int]) -> None:
        self._rows = [r for r in self._rows if r.sid not in sids]

    def load_weights(self, model_path: str, version: str | None) -> str:
        if version is not None:
            self.version = version
        return f"Simulated server: weights at {model_path} accepted without loading"

    def decode_text(self, ids: list[int], skip_special_tokens: bool = True) -> str | None:
        return None

    def tokenize(self, text: str) -> list[int]:
        raise ValueError("the simulated server has no tokenizer: send input_ids")
