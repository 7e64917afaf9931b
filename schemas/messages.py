"""Control messages: pydantic models, msgpack on the wire, a `schema_version` on each.

Each decoder is tied to one type: `decode(PromptTask, data)` raises `MessageError` naming the type and
the problem when the bytes are not a valid `PromptTask` of a version we understand.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1


class MessageError(ValueError):
    """Bytes that are not a valid message of the expected type (a poison message: terminate it)."""


class Message(BaseModel):
    """Base of every control message."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    supported_versions: ClassVar[frozenset[int]] = frozenset({SCHEMA_VERSION})

    schema_version: int = SCHEMA_VERSION


M = TypeVar("M", bound=Message)


def encode(msg: Message) -> bytes:
    return msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)


def decode(cls: type[M], data: bytes) -> M:
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise MessageError(f"{cls.__name__}: not msgpack ({type(exc).__name__}: {exc})") from exc
    if not isinstance(raw, dict):
        raise MessageError(f"{cls.__name__}: expected a map, got {type(raw).__name__}")
    version = raw.get("schema_version")
    if version not in cls.supported_versions:
        raise MessageError(
            f"{cls.__name__}: unsupported schema_version {version!r} "
            f"(this build reads {sorted(cls.supported_versions)})"
        )
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise MessageError(f"{cls.__name__}: {exc}") from exc


# ---------------------------------------------------------------------------------------------- prompts


class PromptTask(Message):
    """One prompt for a rollout worker: a dataset row and how to run it."""

    run: str
    prompt_id: str
    data: dict[str, Any]
    """The dataset row (e.g. {"prompt": ..., "answer": ...}); passed to the workflow as is."""
    is_eval: bool = False
    issued_version: int = 0
    """The trainer's weight version when the feeder issued it."""
    min_version: int = 0
    """The oldest weight version the group may be generated with and still be trained on: a rollout
    worker starts the episode only once its inference servers hold at least this version (0: any;
    absent from messages written before it existed, which decode as 0)."""
    issued_at: float = Field(default_factory=time.time)


class RejectionMarker(Message):
    """The body of a trajectory message whose samples were all rejected (header Jetrl-Status: rejected)."""

    run: str
    prompt_id: str
    worker: str
    reason: str
    is_eval: bool = False


# ---------------------------------------------------------------------------------------------- weights


class WeightFile(Message):
    name: str
    sha256: str
    size: int


class WeightsPublished(Message):
    run: str
    version: int
    uri: str
    """`nats-os://WEIGHTS/<run>/v<N>` (object store) or `file:///abs/dir/v<N>` (shared directory)."""
    files: list[WeightFile]
    step: int
    published_at: float = Field(default_factory=time.time)
    transport: Literal["disk", "broadcast", "colocated"] = "disk"
    """How this version reached the servers. `disk`: fetch `uri`. `broadcast`: the trainer sent it over
    a torch.distributed group to `members`; `colocated`: it handed it to `members` on its own host
    through shared memory (`/update_weights_from_tensor`). For both, `uri`/`files` name the latest disk
    copy (version `disk_version`, empty if none yet), where a server that missed it catches up."""
    members: list[str] = Field(default_factory=list)
    """broadcast: the servers that now serve this version."""
    group: str = ""
    """broadcast: the group's rendezvous address (host:port)."""
    dtype: str = ""
    """broadcast: the dtype the parameters were sent in."""
    buckets: int = 0
    """broadcast: buckets the version was sent in (each checksummed)."""
    bytes: int = 0
    """broadcast: bytes sent to each member."""
    disk_version: int | None = None
    """broadcast: the version of the disk copy `uri` names (None: no disk copy yet)."""
    epoch: int = 0
    """The announcing trainer's epoch: above every earlier trainer's of the run (one more than the
    last announced, at least the Unix time of its start), so a trainer resumed from an older
    checkpoint announces its lower version under a newer epoch. An agent acts only on an
    announcement not older, by (epoch, version), than the newest it accepted: a replayed one is
    refused (signed, it cannot be altered)."""
    signature: str = ""
    """The trainer's HMAC over every other field (`trust.announce_key`); empty: unsigned. A weights
    agent given the key acts only on announcements whose signature checks out."""


class WeightsLoaded(Message):
    run: str
    server: str
    version: int
    seconds: float
    loaded_at: float = Field(default_factory=time.time)
    transport: Literal["disk", "broadcast", "colocated"] = "disk"


class WeightsLoadFailed(Message):
    run: str
    server: str
    version: int
    reason: str
    failed_at: float = Field(default_factory=time.time)
    transport: Literal["disk", "broadcast", "colocated"] = "disk"


# ---------------------------------------------------------------------------------------------- reward


class RewardItem(Message):
    prompt: str = ""
    completion: str = ""
    prompt_ids: list[int] = Field(default_factory=list)
    completion_ids: list[int] = Field(default_factory=list)
    data: dict[str, Any] = Field(default_factory=dict)
    """The dataset row's fields (answer, solution, ...), passed to the function as keyword arguments."""


class RewardRequest(Message):
    fn: str
    """`"module:function"`; must be on the reward service's allow-list."""
    items: list[RewardItem]
    timeout_s: float | None = None
    """Per-item timeout; None means the service's default."""


class RewardResult(Message):
    status: Literal["ok", "timeout", "error"]
    value: float | None = None
    message: str = ""


class RewardReply(Message):
    results: list[RewardResult] = Field(default_factory=list)
    error: str = ""
    """A request-level error (malformed request, function not allowed); then `results` is empty."""


# ---------------------------------------------------------------------------------------------- metrics


class MetricsEvent(Message):
    run: str
    service: str
    worker: str = ""
    step: int | None = None
    version: int | None = None
    time: float = Field(default_factory=time.time)
    values: dict[str, float] = Field(default_factory=dict)
