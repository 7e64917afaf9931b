"""`jetrl bus`: the admin side of the bus.

    jetrl bus init [--config FILE] [key=value ...]    declare the streams and the WEIGHTS bucket (admin user)
    jetrl bus permissions [--run RUN] [--out FILE]    print the nats-server users block, one user per service

See docs/security.md (per-service users).
"""

from __future__ import annotations

import argparse
import sys

USAGE = __doc__.split("\n\n")[1]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    command, rest = args[0], args[1:]
    if command == "init":
        from services.bus.settings import BusSettings
        from services.common.entry import service_main

        return service_main(BusSettings, "services.bus.init:run", rest,
                            "Declare every stream and the WEIGHTS bucket (run it as the admin NATS user).")
    if command in ("permissions", "config"):
        return _permissions(rest)
    print(f"jetrl bus: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


def _permissions(argv: list[str]) -> int:
    from services.common.permissions import ANY_RUN, authorization_block, password_env, users

    parser = argparse.ArgumentParser(
        prog="jetrl bus permissions",
        description="Print the nats-server `authorization` block: an admin user and one user per service, "
        "each allowed only the subjects it needs. Passwords are read by nats-server from the environment: "
        + ", ".join(password_env(u) for u in users()) + ".",
    )
    parser.add_argument("--run", default=ANY_RUN, help="only this run's subjects (default: every run, `*`)")
    parser.add_argument("--out", help="write to this file instead of stdout")
    ns = parser.parse_args(argv)
    try:
        text = authorization_block(ns.run)
    except ValueError as exc:
        print(f"jetrl bus permissions: {exc}", file=sys.stderr)
        return 2
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
