"""`jetrl bus secrets DIR`: one random password per NATS user, each in its own file (what a compose
secret or a Kubernetes Secret key holds), the nats-server variables file the users block includes, and
the trust checks' shared keys."""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path

from services.bus.permissions import passwords_conf, users

PASSWORDS_CONF = "nats-passwords.conf"
TRUST_KEYS = ("announce-key", "inference-admin-key")
_ALPHANUMERIC = string.ascii_letters + string.digits


def new_password(length: int = 32) -> str:
    """A random password nats-server reads back unchanged from either place it can come from: letters
    and digits, a letter first. nats-server parses an environment variable's value as a config value,
    so `token_urlsafe` output such as `-abc...`, `12345...` or `1-2...` would be refused or read as a
    number (about 1 password in 30 failed that way, and the server would not start)."""
    return secrets.choice(string.ascii_letters) + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(length - 1))
"""Beside the passwords, the shared keys of the trust checks: the trainer signs weights announcements
with `announce-key` (`trust.announce_key_file` of the trainer and every weights agent); the inference
servers' admin routes want `inference-admin-key` (`admin_api_key_file` of the server,
`trust.inference_admin_api_key_file` of the weights agent and the trainer)."""


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
        path = _keep_or_make(root / user)
        passwords[user] = path.read_text().strip()
        written.append(path)
    written += [_keep_or_make(root / name) for name in TRUST_KEYS]
    conf = root / PASSWORDS_CONF
    conf.write_text(passwords_conf(passwords))
    os.chmod(conf, 0o644)
    (root / ".gitignore").write_text("# NATS passwords: never committed\n*\n")  # e.g. infra/secrets in a checkout
    return [*written, conf]


def _keep_or_make(path: Path) -> Path:
    """A random secret in `path` unless it already holds one (0644: see `write_secrets`)."""
    if not path.exists() or not path.read_text().strip():
        path.write_text(new_password() + "\n")
        os.chmod(path, 0o644)
    return path
