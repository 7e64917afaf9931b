"""`logging.getLogger(name)` as AReaL's modules call it (`areal.utils.logging`): a standard-library
logger, so `logger.warning("...", exc_info=True)` and f-string messages work as written. jetrl's
services send standard-library records at warning and above to stderr, beside their structlog lines."""

from __future__ import annotations

import logging as _logging


def getLogger(name: str | None = None, type_: str | None = None) -> _logging.Logger:
    return _logging.getLogger(f"jetrl.workflow.{name}" if name else "jetrl.workflow")
