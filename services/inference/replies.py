"""SGLang-shaped JSON answers built from a finished (or in-progress) sequence."""

from __future__ import annotations

import time
from typing import Any

from services.inference.scheduler import Seq


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Per-token versions as SGLang's `weight_versions` spans: `{"version", "start", "end"}`, end exclusive."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def top_rows(seq: Seq) -> list[list[list[Any]]]:
    """SGLang's `output_top_logprobs`: per output position its most likely tokens as
    `[logprob, token_id, null]` triples, most likely first. A position the backend gave none for (the
    simulator has no distribution) holds the sampled token alone."""
    rows = []
    for lp, tok, top in zip(seq.logprobs, seq.output_ids, seq.top_logprobs, strict=True):
        rows.append([[v, t, None] for v, t in top] if top is not None else [[lp, tok, None]])
    return rows


def output_body(seq: Seq, backend: Any, *, return_logprob: bool, server_version: str, text: bool = True) -> dict[str, Any]:
    """One output object of `/generate`. A request aborted before prefill gets SGLang's exact shape:
    empty text and ids, zero token counts and no `output_token_logprobs` key. `text=False` (a
    `skip_tokenizer_init` server): no `text`, and no decoding spent on it."""
    before_prefill = not seq.prefilled and seq.finish is not None and seq.finish.get("type") == "abort"
    ids = list(seq.output_ids)
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish,
        "prompt_tokens": 0 if before_prefill else len(seq.prompt),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "weight_version": server_version,
    }
    if seq.finished_at is not None:
        meta["e2e_latency"] = seq.finished_at - seq.created
    if before_prefill:
        return {"text": "", "output_ids": [], "meta_info": meta}
    meta["weight_versions"] = version_spans(seq.versions)
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.logprobs, ids, strict=True)]
        meta["output_token_logprobs_length"] = len(ids)
        meta["output_top_logprobs"] = top_rows(seq) if seq.params.top_logprobs_num > 0 else None
    body: dict[str, Any] = {"output_ids": ids, "meta_info": meta}
    decoded = backend.decode_text(ids, seq.params.skip_special_tokens) if text else None
    if decoded is not None:
        body["text"] = decoded
    return body


def error_body(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


def models_body(model_path: str, context_length: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model_path,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "jetrl",
                "root": model_path,
                "max_model_len": context_length,
            }
        ],
    }
