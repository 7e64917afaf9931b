"""Whether a weights announcement may be acted on: signed by the trainer (an HMAC under
`trust.announce_key` over the announcement's other fields) and naming weights only under the
configured roots. Both are checked before the agent touches a file or pauses the server; a refusal
names its cause, never a path or a size, since it goes out on the bus in a failure report."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from schemas.messages import WeightsPublished, encode
from services.common.signing import ANNOUNCEMENT, tag, verify
from services.weights.files import parse_uri

REFUSAL_CAUSES = ("unsigned", "bad_signature", "outside_roots", "other_run", "replayed")
"""Why an announcement is refused (each counted as `refused_<cause>`)."""


class Refused(ValueError):
    """An announcement that must not be acted on; `cause` is one of REFUSAL_CAUSES."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def _canonical(msg: WeightsPublished) -> str:
    return encode(msg.model_copy(update={"signature": ""})).hex()


def sign(msg: WeightsPublished, key: bytes) -> WeightsPublished:
    """`msg` with the trainer's signature (unchanged when no key is configured)."""
    return msg.model_copy(update={"signature": tag(key, ANNOUNCEMENT, _canonical(msg))}) if key else msg


def default_roots(run: str, bucket: str) -> list[str]:
    """What the trainer publishes to by default: this run's versions in the object store."""
    return [f"nats-os://{bucket}/{run}/"]


def check(msg: WeightsPublished, key: bytes, roots: list[str]) -> None:
    """Raise `Refused` unless `msg` is signed under `key` (when one is configured) and its URI lies
    under one of `roots`."""
    if key:
        if not msg.signature:
            raise Refused("unsigned", f"announcement of v{msg.version} refused: not signed (trust.announce_key is set)")
        if not verify((key,), msg.signature, ANNOUNCEMENT, _canonical(msg)):
            raise Refused("bad_signature", f"announcement of v{msg.version} refused: its signature does not check out")
    if msg.uri and not under_roots(msg.uri, roots):
        raise Refused("outside_roots", f"announcement of v{msg.version} refused: its uri is outside the configured weight_roots")


class Freshness:
    """The newest (epoch, version) an agent accepted: an announcement of another run, or older than
    that (a lower epoch, or the same epoch and a lower version), is refused. A trainer's epoch only
    grows (`WeightsPublished.epoch`), so a recorded announcement replayed later, signed or not, is
    refused; a resumed trainer's lower version comes under a newer epoch and is accepted."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.newest: tuple[int, int] | None = None

    def check(self, msg: WeightsPublished) -> None:
        if msg.run != self.run:
            raise Refused("other_run", f"announcement of v{msg.version} refused: it is for another run")
        if self.newest is not None and (msg.epoch, msg.version) < self.newest:
            raise Refused("replayed", f"announcement of v{msg.version} (epoch {msg.epoch}) refused: older than "
                                      f"v{self.newest[1]} (epoch {self.newest[0]}), already announced (a replay)")

    def accept(self, msg: WeightsPublished) -> None:
        self.newest = max(self.newest or (msg.epoch, msg.version), (msg.epoch, msg.version))


def under_roots(uri: str, roots: list[str]) -> bool:
    """Whether `uri` names a place under one of `roots` (`file:///dir` or `nats-os://BUCKET[/prefix]`).
    A file path is resolved first (`..` and symbolic links), so it cannot step out of its root."""
    try:
        where = parse_uri(uri)
    except ValueError:
        return False
    for root in roots:
        parsed = urlparse(root)
        if where.scheme == "file" and parsed.scheme == "file" and where.path is not None:
            base = Path(parsed.path).resolve()
            if where.path.resolve().is_relative_to(base):
                return True
        elif where.scheme == "nats-os" and parsed.scheme == "nats-os" and parsed.netloc == where.bucket:
            prefix = parsed.path.strip("/")
            if not prefix or f"{where.prefix}/".startswith(f"{prefix}/"):
                return True
    return False
