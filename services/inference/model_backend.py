"""The transformers backend: one batch of sequences decoded together over a shared, left-padded KV cache.

Iteration-level batching: sequences join (`prefill`) and leave (`remove`) between steps. A joining
group is prefilled on its own (sequences of equal prompt length together, so no padding ever reaches a
prefill) and its cache is left-padded and concatenated onto the batch; an attention mask hides the
padding and per-row position ids keep positions exact, so a token's logits do not depend on what else
is in the batch. Every method runs in the server's single model thread, which is also where weight
updates happen, so a load always falls between two steps.
"""

from __future__ import annotations

import inspect
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import CacheLayerMixin
from transformers.utils import logging as hf_logging

from services.common.logging import get_logger
from services.common.model_path import require_model
from services.inference import penalties
from services.inference.cost import CallCost
from services.inference.grammar import DEAD_END, Grammars
from services.inference.requests import Joining, SamplingParams
from services.inference.sampling import TopLogprobs, sample_top
from services.inference.weights import load_safetensors_into

log = get_logger("inference.model")
Token = tuple[int, int, float, TopLogprobs | None]
"""One generated token: (sid, token, logprob, the position's top log-probs when its request asked)."""


@dataclass
class _Row:
    sid: int
    params: SamplingParams
    generator: torch.Generator
    next_pos: int
    last_token: int = 0
    grammar: Any = None
    """Its `GrammarMatcher` when the request constrains its output (grammar.py)."""
    counts: torch.Tensor | None = None
    """Its output tokens' counts when it has penalties or a logit bias (penalties.py)."""


class TransformersBackend:
    def __init__(self, model_path: str, *, seed: int = 0, version: str = "0", threads: int = 1, tokenizer: bool = True,
                 device: str = "cpu", dtype: str = "float32", attn_implementation: str | None = None,
                 memory_fraction: float = 0.0) -> None:
        """`tokenizer=False` (a `skip_tokenizer_init` server) loads none: ids in, ids out. The model runs
        on `device` in `dtype`; sampling runs on the CPU (float32 logits), so a seeded request draws
        the same way on every device."""
        torch.set_num_threads(threads)
        path = Path(require_model(model_path))  # a name this machine does not have: says what to do
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model_path {model_path!r} has no config.json (build one with `jetrl make-model`)")
        config = AutoConfig.from_pretrained(path)
        # No progress bar: its tqdm monitor thread would outlive the load and wake for the server's lifetime.
        hf_logging.disable_progress_bar()
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device: cuda, but torch sees no CUDA GPU here (torch "
                               f"{torch.__version__}); serve on device: cpu, or install a CUDA build of torch")
        self.device = torch.device(device)
        if self.device.type == "cuda" and memory_fraction > 0:
            torch.cuda.set_per_process_memory_fraction(memory_fraction)  # the rest is the trainer's (one GPU, both)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=attn_implementation)
        self.model = model.to(self.device).eval() if self.device.type != "cpu" else model.eval()  # type: ignore[arg-type]
        self._cache_kw = cache_kwarg(self.model)
        self.model_path = str(path)
        self.tokenizer: Any = None
        if tokenizer:
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(path)
            except Exception as exc:  # a model directory without a tokenizer still serves input_ids
                log.warning("no tokenizer at model_path; text input disabled", error=repr(exc))
        has_files = any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        self.tokenizer_path = self.model_path if self.tokenizer is not None or (not tokenizer and has_files) else None
        """What `/model_info` reports: SGLang reports its tokenizer path even with `--skip-tokenizer-init`
        (clients load it to apply stop strings themselves)."""
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(getattr(config, "max_position_embeddings", 4096))
        eos = config.eos_token_id if config.eos_token_id is not None else []
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.version = version
        self._server_gen = torch.Generator().manual_seed(seed)
        self._rows: list[_Row] = []
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self.forward_rows: dict[str, Counter[int]] = {"prefill": Counter(), "decode": Counter(), "decode+prefill": Counter()}
        """How many rows each model forward ran, per kind (`/server_info`): the batching actually achieved."""
        self.cost = CallCost()
        self._grammars: Grammars | None = None
        self.grammar_failed: dict[int, str] = {}
        """Sids whose grammar allowed no token of the vocabulary in the last step, and why (the
        scheduler ends them with a 400 abort, as SGLang ends a request it cannot serve)."""
        self.grammar_done: set[int] = set()
        """Sids whose grammar completed in the last step (the scheduler finishes them, as SGLang does
        when a grammar terminates: only reached with `ignore_eos`, since a grammar ends on EOS)."""

    @property
    def grammars(self) -> Grammars | None:
        """The grammar compiler (built at first use: xgrammar is imported then); None without a tokenizer."""
        if self._grammars is None and self.tokenizer is not None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._grammars

    def _new_row(self, j: Joining, next_pos: int) -> _Row:
        spec = j.params.grammar
        matcher = None if spec is None or self.grammars is None else self.grammars.matcher(spec)
        counts = torch.zeros(self.vocab_size) if penalties.wants(j.params) else None
        return _Row(j.sid, j.params, self._generator(j.params), next_pos=next_pos, grammar=matcher, counts=counts)

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> list[Token]:
        """Sample a token for each row (its grammar, if any, applied and advanced)."""
        matchers = [r.grammar for r in rows] if any(r.grammar is not None for r in rows) else None
        dead: set[int] = set()
        logits = penalties.adjust(logits, rows)
        tokens, logps, tops = sample_top(logits, [r.params for r in rows], [r.generator for r in rows], matchers, dead)
        penalties.observe(rows, tokens)
        out: list[Token] = []
        for i, (row, tok, lp, top) in enumerate(zip(rows, tokens, logps, tops, strict=True)):
            row.last_token = tok
            out.append((row.sid, tok, lp, top))
            if i in dead:
                self.grammar_failed[row.sid] = DEAD_END.format(kind=row.params.grammar.kind if row.params.grammar else "")
            elif row.grammar is not None and row.grammar.is_terminated():
                self.grammar_done.add(row.sid)
        return out

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    def step(self, remove: set[int], joining: list[Joining]) -> tuple[list[Token], str]:
        """One iteration in one call (one thread hand-off): drop `remove`, decode one token for every
        row already in the batch, then prefill `joining` (their first token). Returns `Token`s.

        The newcomers of the most common prompt length are prefilled inside the decode call when that
        is cheaper (`CallCost`): one model call instead of two, paid for by every running row
        computing that many masked positions. Other lengths are prefilled on their own."""
        self.remove(remove)
        by_len: dict[int, list[Joining]] = defaultdict(list)
        for j in joining:
            by_len[len(j.prompt)].append(j)
        merged: list[Joining] = []
        if self._rows and by_len:
            length, group = max(by_len.items(), key=lambda kv: len(kv[1]))
            if self.cost.worth_merging(len(self._rows) * (length - 1)):
                merged = by_len.pop(length)
        out = self._decode_joining(merged)
        for group in by_len.values():
            out += self.prefill(group)[0]
        return out, self.version

    def _generator(self, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._server_gen
        return torch.Generator().manual_seed(params.seed)

    @torch.inference_mode()
    def prefill(self, joining: list[Joining]) -> tuple[list[Token], str]:
        """Run the prompts of `joining`, add them to the batch; returns their first `Token`s."""
        by_len: dict[int, list[Joining]] = defaultdict(list)
        for j in joining:
            by_len[len(j.prompt)].append(j)
        out: list[Token] = []
        for length, group in by_len.items():
            # Identical prompts (a group's samples: one prompt, n completions) are run once; each
            # request's row then gets a copy of that prompt's logits and cache, and samples on its own.
            unique, which = _dedup([j.prompt for j in group])
            ids = torch.tensor(unique, dtype=torch.long, device=self.device)
            cache = DynamicCache()
            self.forward_rows["prefill"][len(unique)] += 1
            logits = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache}).logits[:, -1, :].float().cpu()
            layers = _keys_values(cache)
            if which is not None:
                logits = logits.index_select(0, which)
                on = which.to(self.device)
                layers = [(k.index_select(0, on), v.index_select(0, on)) for k, v in layers]
            rows = [self._new_row(j, length) for j in group]
            out += self._sample(logits, rows)
            self._merge(rows, layers, torch.ones(len(group), length, dtype=torch.long))
        return out, self.version

    def _merge(self, rows: list[_Row], layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        if not self._rows:
            self._rows = rows
            self._keys = [k for k, _ in layers]
            self._values = [v for _, v in layers]
            self._mask = mask
            return
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        width = max(old_len, new_len)
        self._keys = [torch.cat([_lpad(a, width), _lpad(b, width)]) for a, (b, _) in zip(self._keys, layers, strict=True)]
        self._values = [torch.cat([_lpad(a, width), _lpad(b, width)]) for a, (_, b) in zip(self._values, layers, strict=True)]
        self._mask = torch.cat([_lpad(self._mask, width), _lpad(mask, width)])
        self._rows = self._rows + rows

    def decode(self) -> tuple[list[Token], str]:
        """One `Token` for every sequence in the batch."""
        return self._decode_joining([]), self.version

    @torch.inference_mode()
    def _decode_joining(self, joining: list[Joining]) -> list[Token]:
        """One model call: a token for every running row and the prompts of `joining` (all of one
        length L; none: a plain decode). The call's query is L wide: a running row's token sits last,
        after L-1 masked positions; a newcomer's cache is masked zeros up to the batch's width. The
        mask and per-row positions keep every row's logits those of its own sequence alone."""
        run = len(self._rows)
        if not run:
            return self.prefill(joining)[0] if joining else []
        # Identical prompts run once (as in `prefill`); their rows are copied out after the call.
        unique, which = _dedup([j.prompt for j in joining])
        new = len(unique)
        length = len(joining[0].prompt) if joining else 1
        width = self._mask.shape[1]
        ids = torch.zeros(run + new, length, dtype=torch.long)
        ids[:run, -1] = torch.tensor([r.last_token for r in self._rows], dtype=torch.long)
        pos = torch.tensor([r.next_pos for r in self._rows], dtype=torch.long).unsqueeze(1).expand(run, length)
        mask = torch.zeros(run + new, width + length, dtype=torch.long)
        mask[:run, :width] = self._mask
        mask[:run, -1] = 1
        keys, values = self._keys, self._values
        rows = self._rows
        if joining:
            ids[run:] = torch.tensor(unique, dtype=torch.long)
            pos = torch.cat([pos, torch.arange(length).unsqueeze(0).expand(new, length)])
            mask[run:, width:] = 1
            keys = [torch.cat([k, k.new_zeros(new, *k.shape[1:])]) for k in keys]
            values = [torch.cat([v, v.new_zeros(new, *v.shape[1:])]) for v in values]
            rows = rows + [self._new_row(j, length) for j in joining]
        self.forward_rows["decode+prefill" if joining else "decode"][run + new] += 1
        cache = DynamicCache(ddp_cache_data=list(zip(keys, values, strict=True)))
        started = time.thread_time()
        dev = self.device
        logits = self.model(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev), use_cache=True, logits_to_keep=1,
            **{self._cache_kw: cache},
        ).logits[:, -1, :].float().cpu()
        if not joining:
            self.cost.observe(run, time.thread_time() - started)
        layers = _keys_values(cache)
        if which is not None:
            expand = torch.cat([torch.arange(run), run + which])
            logits, mask = logits.index_select(0, expand), mask.index_select(0, expand)
            on = expand.to(dev)
            layers = [(k.index_select(0, on), v.index_select(0, on)) for k, v in layers]
        self._keys = [k for k, _ in layers]
        self._values = [v for _, v in layers]
        self._mask = mask
        for r in self._rows:
            r.next_pos += 1
        self._rows = rows
        return self._sample(logits, rows)

    def remove(self, sids: set[int]) -> None:
        """Drop finished or aborted sequences; trim padding columns no remaining row needs."""
        keep = [i for i, r in enumerate(self._rows) if r.sid not in sids]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._keys, self._values = [], [], []
            self._mask = torch.zeros(0, 0, dtype=torch.long)
            return
        index = torch.tensor(keep)
        self._rows = [self._rows[i] for i in keep]
        mask = self._mask.index_select(0, index)
        used = mask.any(dim=0)
        on = index.to(self.device)
        if bool(used.all()):
            self._mask = mask
            self._keys = [k.index_select(0, on) for k in self._keys]
            self._values = [v.index_select(0, on) for v in self._values]
            return
        # Columns no remaining row attends to (padding, or the positions of rows that left) go.
        cols = used.nonzero().squeeze(1)
        self._mask = mask.index_select(1, cols)
        cols_on = cols.to(self.device)
        self._keys = [k.index_select(0, on).index_select(2, cols_on) for k in self._keys]
        self._values = [v.index_select(0, on).index_select(2, cols_on) for v in self._values]

    def load_weights(self, model_path: str, version: str | None) -> str:
        """Load a checkpoint's safetensors in place (between steps); raises WeightLoadError and
        leaves the old weights serving when the path or a shape is wrong."""
        count = load_safetensors_into(self.model, model_path)
        if version is not None:
            self.version = version
        return f"Succeeded to update model weights: {count} tensors from {model_path}"

    def decode_text(self, ids: list[int], skip_special_tokens: bool = True) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)



def _dedup(prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor | None]:
    """The distinct prompts, in first-seen order, and for each input its index among them (None when
    all are distinct: nothing to expand)."""
    index: dict[tuple[int, ...], int] = {}
    which = [index.setdefault(tuple(p), len(index)) for p in prompts]
    if len(index) == len(prompts):
        return prompts, None
    return [list(p) for p in index], torch.tensor(which, dtype=torch.long)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword the model's forward takes its KV cache by: `cache` (transformers >= 5.x; the old
    `past_key_values` is deprecated there and goes in 5.40), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _keys_values(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values). The batch is kept as attention keys and values per layer; a cache
    layer without them (linear attention state) is a model this server cannot batch: say so here."""
    out = []
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise TypeError(f"cache layer {i} is a {type(layer).__name__} without keys and values")
        out.append((layer.keys, layer.values))
    return out

def _lpad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the sequence dimension (-2 for [B, H, L, D] caches, -1 for [B, L] masks) with zeros."""
    dim = -1 if t.dim() == 2 else -2
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
