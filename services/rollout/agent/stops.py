"""Stop strings applied by the proxy on the decoded completion, whatever the inference server did.

A server may not apply `stop` itself (an SGLang server without a tokenizer cannot; other servers cut
after the matching token), so the proxy finds the first point where the decoded text contains a stop
string and cuts there: the answered text ends before the stop string (what OpenAI and Anthropic
specify), and the recorded completion ends with the token that completed it. Tokens generated after
that token were never part of the answer the agent saw and are dropped from the record, so the tokens
trained on are exactly the ones whose text was answered (plus the stop string's own tokens, as with an
end-of-sequence token). Idempotent: a completion the server already cut is cut at the same place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopCut:
    keep: int
    """How many output tokens the completion keeps."""
    text: str
    """The answered text: the kept tokens' text up to the stop string."""
    matched: str | None
    """The stop string found, or None when there was none."""


def _first(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits, key=lambda hit: hit[0]) if hits else None


def cut_at_stop(ids: list[int], stops: list[str], decode: Callable[[list[int]], str]) -> StopCut:
    """The completion `ids` cut at the first stop string of its decoded text."""
    full = decode(ids)
    if not stops or _first(full, stops) is None:
        return StopCut(len(ids), full, None)
    # the fewest tokens whose text holds a stop string: the text of a prefix grows with it, so bisect
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        if _first(decode(ids[:mid]), stops) is None:
            low = mid + 1
        else:
            high = mid
    text = decode(ids[:low])
    pos, matched = _first(text, stops) or (len(text), None)
    return StopCut(low, text[:pos], matched)
