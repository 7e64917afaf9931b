"""structlog setup: JSON when not on a terminal (containers, files), pretty on one.

Context (run, service, worker, step, version, prompt_id) is bound with `bind_context`, which uses
structlog's contextvars so every log line of a task carries it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure_logging(level: str = "info", fmt: str = "auto", **context: Any) -> None:
    json_out = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log_level {level!r}: expected debug, info, warning or error")
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json_out:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors += [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries that use stdlib logging (nats, aiohttp) go to stderr at warning and above.
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    structlog.contextvars.clear_contextvars()
    bind_context(**context)


def bind_context(**context: Any) -> None:
    structlog.contextvars.bind_contextvars(**{k: v for k, v in context.items() if v is not None})


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)
