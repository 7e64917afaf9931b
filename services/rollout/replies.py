"""An inference server's HTTP reply body, as the client reads it."""

from __future__ import annotations

import json
from typing import Any

import orjson


def json_or_text(text: str) -> Any:
    """A reply's JSON (orjson: parsing `/generate`'s replies is a per-sample cost, several times
    faster than the stdlib's), or its text where it is not JSON."""
    try:
        return orjson.loads(text)
    except ValueError:  # not JSON, or what only the stdlib reads (an integer past 64 bits)
        try:
            return json.loads(text)
        except ValueError:
            return text
