"""The SGLang `/generate` protocol as pure functions: build a payload, parse a reply.

No I/O here, so the interruptible-generation loop in `engine.py` stays small and every shape SGLang can
answer (including the "Abort before prefill" reply with no logprobs) is tested without a server.
Field names follow SGLang's `io_struct.py` (see shared/reference/sglang-protocol.md).
"""

from __future__ import annotations

from dataclasses import dataclass
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


def build_generate_payload(
    input_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    stop_token_ids: list[int] | None = None,
    stop: list[str] | None = None,
    ignore_eos: bool = False,
    seed: int | None = None,
    rid: str | None = None,
) -> dict[str, Any]:
    """The body of one `/generate` pass: token ids in, output logprobs requested, no streaming."""
    sampling: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "ignore_eos": ignore_eos,
    }
    if stop_token_ids:
        sampling["stop_token_ids"] = list(stop_token_ids)
    if stop:
        sampling["stop"] = list(stop)
    if seed is not None:
        sampling["sampling_seed"] = seed
    payload: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    if rid is not None:
        payload["rid"] = rid
    return payload


@dataclass
class GeneratePass:
    """What one `/generate` answer contributed."""

    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_type: str
    """"stop" | "length" | "abort"."""
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
