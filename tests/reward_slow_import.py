"""A reward module that takes a while to import (like one that loads a large library), for the reward
service's tests: the import must not count against an item's timeout."""

from __future__ import annotations

import time
from typing import Any

time.sleep(1.5)


def length(completion: str = "", **_: Any) -> float:
    return float(len(completion))
