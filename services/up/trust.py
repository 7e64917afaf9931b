"""The run's announcement key: `jetrl up` makes one per run so its trainer signs every weights
announcement and its agents act on signed ones only (docs/security.md), unless the config gives the
trainer or the agents a key of its own."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

KEY_FILE = "announce-key"


def announce_trust(run_dir: Path, sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`{"trust": {"announce_key_file": ...}}` for the trainer's and the agents' sections, the key
    written once into the run directory (0600, kept on a resumed run); `{}` where the config sets
    `trust.announce_key` or `trust.announce_key_file` itself for either."""
    for name in ("trainer", "weights"):
        trust = sections.get(name, {}).get("trust") or {}
        if trust.get("announce_key") or trust.get("announce_key_file"):
            return {}
    path = run_dir / KEY_FILE
    if not path.exists() or not path.read_text().strip():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return {"trust": {"announce_key_file": str(path)}}
