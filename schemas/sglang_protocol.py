"""The SGLang `/generate` protocol as pure functions: build a payload, parse a reply.

No I/O here, so the interruptible-generation loop in `engine.py` stays small and every shape SGLang can
answer (including the "Abort before prefill" reply with no logprobs) is tested without a server.
Field names follow SGLang's `io_struct.py`; the facts per SGLang version are in docs/sglang.md and are
checked by the contract tier (tests/contract/) against SGLang's own code.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FINISHED = ("stop", "length")
"""Finish types that end a generation; anything else ("abort") is continued."""


class ProtocolError(ValueError):
    """A reply that does not have the shape of an SGLang `/generate` answer."""


def parse_version(raw: Any) -> int:
    """SGLang carries the weight version as a string; ours are integers and `"default"` means 0."""
    if raw is None or raw == "" or raw == "default":
        return 0
    if isinstance(raw, bool):
        raise ProtocolError(f"weight_version {raw!r} is not an integer")
    try:
        return int(raw)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"weight_version {raw!r} is not an integer (jetrl sends str(int))") from exc


MIN_VERSION = (0, 5, 19)
"""Oldest SGLang jetrl supports: per-token `meta_info.weight_versions` start here. Before, a reply tags
all its tokens with the version current when it ends, so a request held through an `in_place` or
`retract` load would carry the new version on tokens the old weights produced (see docs/sglang.md)."""
MODEL_INFO = "/model_info"
"""Where the server's `weight_version` is read (SGLang's `/get_model_info` is deprecated: a warning per call)."""


def parse_server_version(raw: Any) -> tuple[int, ...] | None:
    """`"0.5.23"` / `"0.5.15.post1"` / `"v0.5.6rc0"` -> (0, 5, 23) ...; None when it carries no version."""
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(raw or ""))
    if match is None:
        return None
    return tuple(int(g) for g in match.groups() if g is not None)


def version_text(version: tuple[int, ...] | None) -> str:
    return "unknown" if version is None else ".".join(map(str, version))


def check_server_version(url: str, version: tuple[int, ...] | None) -> None:
    """Raise `ProtocolError` naming the version and the missing feature when `url` is too old for jetrl."""
    if version is None:
        return  # no version reported (a router in front): nothing to refuse on
    if version < MIN_VERSION:
        raise ProtocolError(
            f"{url} runs SGLang {version_text(version)}; jetrl needs >= {version_text(MIN_VERSION)} "
            "(per-token weight versions, meta_info.weight_versions, are missing)"
        )


READY_POLL_TIMEOUT_S = 30.0
"""How long one readiness poll may take: SGLang's `/health` runs a test generation (a second or more,
up to 20 s while paused)."""


def readiness_urls(base_url: str) -> tuple[str, str]:
    """What a readiness check polls (passing when either answers 2xx): SGLang's own `/ready` (0.5.20+,
    answers at once, also while paused), else `/health`, which runs a test generation and so waits out a
    pause (503 after 20 s): give it a timeout of tens of seconds."""
    base = base_url.rstrip("/")
    return f"{base}/ready", f"{base}/health"


def find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The first stop string in `text`: (index where it ends, the stop), or None. Earliest end wins, the
    longer stop on a tie, as a server scanning token by token would see it."""
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        at = text.find(stop)
        if at < 0:
            continue
        end = at + len(stop)
        if best is None or end < best[0] or (end == best[0] and len(stop) > len(best[1])):
            best = (end, stop)
    return best


def cut_at_stop(ids: list[int], stops: list[str], decode: Callable[[list[int]], str]) -> tuple[int, str] | None:
    """Apply stop strings client-side (SGLang refuses `stop` with `--skip-tokenizer-init`): the number of
    tokens to keep (up to and including the token that completes the match) and the matched stop, or None."""
    if not stops or not ids or find_stop(decode(ids), stops) is None:
        return None
    lo, hi = 1, len(ids)  # the shortest prefix whose text holds a stop (text only grows with tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if find_stop(decode(ids[:mid]), stops) is not None:
            hi = mid
        else:
            lo = mid + 1
    found = find_stop(decode(ids[:lo]), stops)
    assert found is not None
    return lo, found[1]


def build_generate_payload(
    input_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    seed: int | None = None,
    rid: str | None = None,
    top_logprobs_num: int = 0,
    json_schema: str | None = None,
    regex: str | None = None,
    ebnf: str | None = None,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    logit_bias: dict[int, float] | None = None,
) -> dict[str, Any]:
    """The body of one `/generate` pass: token ids in, output logprobs requested, no streaming. Stop
    strings are never sent (a `--skip-tokenizer-init` server refuses them, older ones ignored them): the
    engine applies them to the output itself. `sampling_seed` is sent but only honoured by a server
    started with `--enable-deterministic-inference`; nothing relies on it. `top_logprobs_num` > 0 asks
    for that many most likely tokens per output position as well. `json_schema` / `regex` / `ebnf`
    (at most one) constrain the output while decoding; SGLang needs its tokenizer for them (a server
    started with `--skip-tokenizer-init` has no grammar backend and fails the request)."""
    sampling: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "ignore_eos": ignore_eos,
    }
    if stop_token_ids:
        sampling["stop_token_ids"] = list(stop_token_ids)
    if seed is not None:
        sampling["sampling_seed"] = seed
    for name, constraint in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf)):
        if constraint:
            sampling[name] = constraint
    if frequency_penalty:
        sampling["frequency_penalty"] = frequency_penalty
    if presence_penalty:
        sampling["presence_penalty"] = presence_penalty
    if logit_bias:
        sampling["logit_bias"] = {str(k): float(v) for k, v in logit_bias.items()}  # SGLang's keys are strings
    payload: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    if top_logprobs_num > 0:
        payload["top_logprobs_num"] = top_logprobs_num
    if rid is not None:
        payload["rid"] = rid
    return payload


BATCHED = ("input_ids", "sampling_params", "rid")
"""The fields of a `/generate` payload that a batch carries as one list entry per input; every other
field must be equal across the batch (`batch_key`)."""


def batch_key(payload: dict[str, Any]) -> tuple[Any, ...]:
    """Payloads with equal keys can share one batched `/generate`: the same scalar fields (logprob
    settings, streaming), and either all or none carrying a `rid` (SGLang wants a list of one per input
    or none)."""
    return (*sorted((k, v) for k, v in payload.items() if k not in BATCHED), "rid" in payload)


def build_batch_payload(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """One `/generate` body for several passes (SGLang's batch form): `input_ids` a list of prompts,
    `sampling_params` and `rid` one entry per prompt, the shared fields once. The reply is a list of
    outputs in the same order (`split_batch_reply`)."""
    if not payloads:
        raise ValueError("build_batch_payload needs at least one payload")
    first = payloads[0]
    key = batch_key(first)
    for p in payloads[1:]:
        if batch_key(p) != key:
            raise ValueError(f"payloads differ beyond {BATCHED}: cannot batch them")
    body = {k: v for k, v in first.items() if k not in BATCHED}
    body["input_ids"] = [p["input_ids"] for p in payloads]
    body["sampling_params"] = [p["sampling_params"] for p in payloads]
    if "rid" in first:
        body["rid"] = [p["rid"] for p in payloads]
    return body


def split_batch_reply(body: Any, count: int) -> list[Any]:
    """A batched `/generate` answer: a list of `count` outputs, each parsed by `parse_generate_reply`."""
    if not isinstance(body, list):
        raise ProtocolError(f"batched /generate answered {type(body).__name__}, expected a list of {count} outputs")
    if len(body) != count:
        raise ProtocolError(f"batched /generate answered {len(body)} outputs for {count} inputs")
    return body


@dataclass
class GeneratePass:
    """What one `/generate` answer contributed."""

    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_type: str
    """"stop" | "length" | "abort"."""
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per output token its most likely (token id, logprob), most likely first; empty when the reply
    carries none (not asked, or an abort before prefill)."""
    finish_message: str = ""
    status_code: int | None = None
    """Set on an abort the server caused for a reason of its own (e.g. 400 for a bad request)."""

    @property
    def finished(self) -> bool:
        return self.finish_type in FINISHED


def _versions(meta: dict[str, Any], n: int) -> list[int]:
    """Per-token versions: the `weight_versions` spans when the server sends them (newer SGLang),
    else every token of this pass carries `weight_version`."""
    default = parse_version(meta.get("weight_version"))
    out = [default] * n
    spans = meta.get("weight_versions")
    if isinstance(spans, list):
        for span in spans:
            if not isinstance(span, dict):
                raise ProtocolError(f"weight_versions entry {span!r} is not a mapping")
            version = parse_version(span.get("version"))
            start = max(0, int(span.get("start", 0)))
            end = min(n, int(span.get("end", n)))  # end is exclusive
            for i in range(start, end):
                out[i] = version
    return out


def _top_logprobs(meta: dict[str, Any], n: int) -> list[list[tuple[int, float]]]:
    """`output_top_logprobs` (per position a list of `[logprob, token_id, text_or_null]`) as
    (token id, logprob) pairs; [] when null or absent."""
    rows = meta.get("output_top_logprobs")
    if rows is None:
        return []
    if not isinstance(rows, list) or len(rows) != n:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise ProtocolError(f"/generate output_top_logprobs has {got} positions for {n} output tokens")
    try:
        return [[(int(entry[1]), float(entry[0])) for entry in row or ()] for row in rows]
    except (TypeError, ValueError, IndexError) as exc:
        raise ProtocolError(f"/generate output_top_logprobs entries are not [logprob, token_id, text]: {exc}") from exc


def parse_generate_reply(body: Any) -> GeneratePass:
    """Parse one (non-batched) `/generate` answer into tokens, logprobs, versions and finish."""
    if not isinstance(body, dict):
        raise ProtocolError(f"/generate answered {type(body).__name__}, expected one output object")
    if "error" in body:
        err = body["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        raise ProtocolError(f"/generate error: {msg}")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise ProtocolError("/generate reply has no meta_info")
    finish = meta.get("finish_reason")
    if isinstance(finish, str):  # some builds send the bare type
        finish = {"type": finish}
    if not isinstance(finish, dict) or "type" not in finish:
        raise ProtocolError(f"/generate reply has no finish_reason type (got {finish!r})")
    ftype = str(finish["type"])

    lp_rows = meta.get("output_token_logprobs")
    output_ids = body.get("output_ids")
    if lp_rows is None:
        # "Abort before prefill" (and builds without return_logprob) carry no logprob key: only an
        # empty output is usable then, since a token without its logprob cannot be trained on.
        if output_ids:
            raise ProtocolError(f"/generate returned {len(output_ids)} tokens but no output_token_logprobs")
        ids: list[int] = []
        logprobs: list[float] = []
    else:
        ids = [int(row[1]) for row in lp_rows]
        logprobs = [float(row[0]) for row in lp_rows]
        if output_ids is not None and list(output_ids) != ids:
            raise ProtocolError("/generate output_ids disagree with output_token_logprobs")

    status = finish.get("status_code")
    return GeneratePass(
        output_ids=ids,
        output_logprobs=logprobs,
        output_versions=_versions(meta, len(ids)),
        finish_type=ftype,
        output_top_logprobs=_top_logprobs(meta, len(ids)) if ids else [],
        finish_message=str(finish.get("message") or ""),
        status_code=int(status) if isinstance(status, int) else None,
    )


def error_message(body: Any, fallback: str) -> str:
    """The message of SGLang's error shape `{"error": {"message": ...}}`, or `fallback`."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message"):
            return str(body["message"])
    return fallback
