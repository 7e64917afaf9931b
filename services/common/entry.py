"""The thin entry point of every service: parse and validate settings, set up logging, and only then
import the service's heavy modules (torch, transformers) and run it until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import textwrap
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from services.common.logging import configure_logging, get_logger
from services.common.settings import ServiceSettings, SettingsError, describe, flags, load_settings

CONFIG_HELP = "YAML file with settings (a section named after the service is used if present)"


def settings_help(cls: type[ServiceSettings]) -> str:
    rows = describe(cls)
    width = min(max(len(k) for k, _, _ in rows), 36)
    lines = [f"settings (YAML key | env {cls.env_prefix()}<KEY with __ for dots> | CLI key=value):"]
    for key, default, doc in rows:
        lines.append(f"  {key:<{width}}  default {default}")
        for line in textwrap.wrap(doc, 88):
            lines.append(f"  {'':<{width}}    {line}")
    return "\n".join(lines)


def build_parser(prog: str, description: str, cls: type[ServiceSettings], *, config_help: str = CONFIG_HELP,
                 epilog: str = "") -> argparse.ArgumentParser:
    """`--config FILE`, the flags `cls` declares (`settings.flag`), then `key=value` overrides."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=settings_help(cls) + (f"\n\n{epilog}" if epilog else ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help=config_help)
    for f in flags(cls):
        # argparse %-formats a flag's help: a literal "%" in a docstring ("~25%") must be escaped
        doc = f"{f.key}={'true' if f.switch else '...'}: {f.doc}" if f.doc else f.key
        doc = doc.replace("%", "%%")
        if f.switch:
            parser.add_argument(f.name, dest=f.key, action="store_const", const="true", help=doc)
        elif f.bare is not None:
            parser.add_argument(f.name, dest=f.key, nargs="?", const=f.bare, metavar="VALUE", help=f"{doc} (alone: {f.bare})")
        else:
            parser.add_argument(f.name, dest=f.key, metavar="VALUE", help=doc)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="setting overrides, e.g. run=demo")
    return parser


@dataclass(frozen=True)
class CommandLine:
    config: str | None
    """The `--config` file, if given."""
    overrides: list[str]
    """`key=value` overrides, the flags given spelled as such (after the others: a flag wins)."""


def read_command_line(cls: type[ServiceSettings], argv: list[str] | None, prog: str, description: str, *,
                      config_help: str = CONFIG_HELP, epilog: str = "") -> CommandLine:
    """Parse `argv` for `cls`: `--help`, `--config`, its declared flags and `key=value` overrides, in any order."""
    parser = build_parser(prog, description, cls, config_help=config_help, epilog=epilog)
    args = vars(parser.parse_intermixed_args(argv))
    given = [f"{f.key}={args[f.key]}" for f in flags(cls) if args.get(f.key) is not None]
    return CommandLine(args["config"], [*args["overrides"], *given])


def parse_settings(cls: type[ServiceSettings], argv: list[str] | None, prog: str, description: str) -> ServiceSettings:
    line = read_command_line(cls, argv, prog, description)
    try:
        return load_settings(cls, line.config, line.overrides)
    except SettingsError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def service_main(
    cls: type[ServiceSettings],
    target: str,
    argv: list[str] | None = None,
    description: str = "",
    *,
    uses_bus: bool = True,
    **log_context: Any,
) -> int:
    """Parse settings for `cls`, configure logging, import `target` ("module:function", an async
    function taking the settings and the service's `Bus`, made here from them; only the settings
    when `uses_bus` is False) and run it."""
    prog = f"jetrl {cls.service}"
    settings = parse_settings(cls, argv, prog, description)
    configure_logging(settings.log_level, settings.log_format, run=settings.run, service=cls.service, **log_context)
    module_name, _, func_name = target.partition(":")
    func: Callable[..., Awaitable[None]] = getattr(importlib.import_module(module_name), func_name)
    from services.common.bus import Bus
    from services.common.health import run_with_health  # after settings: keeps --help instant

    # how every NATS connection of this service authenticates, what it declares and how its calls are
    # retried (the store alarm asking `nats_monitor_url`, the stop that ends retries): one object, handed over
    bus = Bus.of(settings) if uses_bus else None

    async def body() -> None:
        # The side port (/healthz, /readyz, /metrics) lives as long as the service, when health_port is set.
        try:
            service = func(settings) if bus is None else func(settings, bus)
            await run_with_health(settings.health_port, service, settings.health_host)
        except BaseException as exc:
            _exit_unless_ended(130 if isinstance(exc, KeyboardInterrupt) else 1)
            raise
        _exit_unless_ended(0)

    try:
        asyncio.run(body())
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        get_logger(cls.service).error("service failed", error=repr(exc), exc_info=exc)
        return 1
    return 0


EXIT_GRACE_S = 2.0
"""After the service's own stop (bounded by `shutdown_timeout_s`), how long asyncio's teardown may
take before the process ends anyway."""


def _exit_unless_ended(code: int) -> None:
    """End the process with `code` if it is still alive EXIT_GRACE_S from now. asyncio.run's teardown
    waits without a bound for tasks to take their cancellation and for executor threads to return; a
    client whose peer is gone (nats-py draining subscriptions on a loaded machine, a thread blocked on a
    socket) can hold it there long after the service has stopped. A daemon timer: a normal exit
    ends it unused."""
    import threading

    def end() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(EXIT_GRACE_S, end)
    timer.daemon = True
    timer.start()
