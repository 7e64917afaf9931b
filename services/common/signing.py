"""HMAC tags that say who made a message: the trainer's prompts (a key of the run, or an issuer's key
for `jetrl prompts push`) and its weights announcements (a key shared with the weights agents).

A tag is HMAC-SHA256 over a purpose word and the message's identifying fields, hex-encoded; checked in
constant time. Whoever holds the key can make tags, so a key is given only to the side that signs and
the side that checks (never to rollout workers: they copy a prompt's tag, they cannot make one).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from pydantic import SecretStr


def load_key(value: SecretStr, path: str, what: str) -> bytes:
    """A key from its setting or from the file the setting names (`*_file`, e.g. a mounted secret);
    empty bytes when neither is set. The error names the setting, never the key."""
    if value.get_secret_value() and path:
        raise ValueError(f"{what}: set the key or its _file, not both")
    if path:
        try:
            text = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"{what}_file: cannot read {path}: {exc.strerror}") from exc
        if not text:
            raise ValueError(f"{what}_file: {path} is empty")
        return text.encode()
    return value.get_secret_value().encode()


def tag(key: bytes, purpose: str, *fields: str) -> str:
    """The tag of `fields` (joined with newlines, after `purpose`) under `key`."""
    body = "\n".join((purpose, *fields)).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def verify(keys: tuple[bytes, ...], given: str, purpose: str, *fields: str) -> bool:
    """Whether `given` is the tag of `fields` under any of `keys`."""
    return bool(given) and any(hmac.compare_digest(tag(k, purpose, *fields), given) for k in keys if k)


PROMPT = "jetrl-prompt-v1"
"""Purpose of a prompt tag: over (run, prompt id)."""
ANNOUNCEMENT = "jetrl-weights-v1"
"""Purpose of a weights announcement's signature: over the announcement's canonical bytes."""


def prompt_tag(key: bytes, run: str, prompt_id: str) -> str:
    return tag(key, PROMPT, run, prompt_id)


def prompt_tag_ok(keys: tuple[bytes, ...], given: str, run: str, prompt_id: str) -> bool:
    return verify(keys, given, PROMPT, run, prompt_id)
