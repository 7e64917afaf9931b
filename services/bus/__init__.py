"""`jetrl bus`: the admin side of the bus (docs/security.md, "Per-service users").

    jetrl bus init [--config FILE] [key=value ...]   declare the streams and the WEIGHTS bucket (admin user)
    jetrl bus permissions [--run RUN] [--passwords-include PATH] [--out FILE]
                                                     print the nats-server users block, one user per service
    jetrl bus secrets DIR                            a random password per user in DIR, DIR/nats-passwords.conf, and the trust keys
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
    if command == "secrets":
        return _secrets(rest)
    print(f"jetrl bus: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


def _permissions(argv: list[str]) -> int:
    from services.bus.permissions import ANY_RUN, authorization_block, password_env, users

    parser = argparse.ArgumentParser(
        prog="jetrl bus permissions",
        description="Print the nats-server `authorization` block: an admin user and one user per service, "
        "each allowed only the subjects it needs. Each password is a nats-server variable ("
        + ", ".join(password_env(u) for u in users()) + "): from --passwords-include, else the server's environment.",
    )
    parser.add_argument("--run", default=ANY_RUN, help="only this run's subjects (default: every run, `*`)")
    parser.add_argument("--passwords-include", default="",
                        help="include this file (relative to the users file) for the password variables: "
                        "the nats-passwords.conf `jetrl bus secrets` writes")
    parser.add_argument("--out", help="write to this file instead of stdout")
    ns = parser.parse_args(argv)
    try:
        text = authorization_block(ns.run, passwords_include=ns.passwords_include)
    except ValueError as exc:
        print(f"jetrl bus permissions: {exc}", file=sys.stderr)
        return 2
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _secrets(argv: list[str]) -> int:
    from services.bus.secrets import write_secrets

    parser = argparse.ArgumentParser(
        prog="jetrl bus secrets",
        description="Write a random password per NATS user into DIR/<user> (kept if already there) and "
        "DIR/nats-passwords.conf, the file the users block includes. Prints only file names.",
    )
    parser.add_argument("dir", help="directory for the secrets (created, mode 0700)")
    ns = parser.parse_args(argv)
    for path in write_secrets(ns.dir):
        print(path)
    return 0
