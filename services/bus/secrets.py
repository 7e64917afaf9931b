"""`jetrl bus secrets DIR`: one random password per NATS user, each in its own file (what a compose
secret or a Kubernetes Secret key holds), and the nats-server variables file the users block includes."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from services.common.permissions import passwords_conf, users

PASSWORDS_CONF = "nats-passwords.conf"


def write_secrets(directory: str | Path) -> list[Path]:
    """Create DIR (0700) with DIR/<user> for every user (an existing file is kept: re-running never
    changes a password a running server uses) and DIR/nats-passwords.conf from them. The user files
    are 0644: compose bind-mounts them into containers running as another uid; the directory is what
    keeps them private on the host."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    passwords: dict[str, str] = {}
    written = []
    for user in users():
        path = root / user
        if not path.exists() or not path.read_text().strip():
            path.write_text(secrets.token_urlsafe(24) + "\n")
            os.chmod(path, 0o644)
        passwords[user] = path.read_text().strip()
        written.append(path)
    conf = root / PASSWORDS_CONF
    conf.write_text(passwords_conf(passwords))
    os.chmod(conf, 0o644)
    (root / ".gitignore").write_text("# NATS passwords: never committed\n*\n")  # e.g. infra/secrets in a checkout
    return [*written, conf]
