"""`weights`: how the trainer's weight versions reach the inference servers, one discriminated setting.

`weights.transport` picks the path, and each path has its own settings beside it:
- `store` (the default): every version into the run's WEIGHTS object store; the agents load it.
- `shared_dir`: every version into a directory the agents can read (`weights.dir`).
- `colocated`: in memory, through shared memory on this host, to `weights.servers`.
- `broadcast`: in memory, over a torch.distributed group, to `weights.servers` on any host.
- `none`: nothing is published (a replay's default).

The in-memory paths also write a disk copy every `disk_every` versions (into the object store, or
`disk_dir`), where a server that joins late catches up.

The flat settings of earlier releases (`publish_weights`, `weights_shared_dir`, `weights_keep_last`,
`weights_broadcast.*`) are still read, with a warning naming the new spelling (`legacy_weights`).
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from services.common.settings import Section

TRANSPORTS = ("store", "shared_dir", "colocated", "broadcast", "none")


class StoreSync(Section):
    transport: Literal["store"] = "store"
    """Each version into the run's WEIGHTS object store (NATS), where the agents fetch it."""
    keep_last: int = Field(3, ge=1)
    """Published versions kept; older ones are deleted."""


class SharedDirSync(Section):
    transport: Literal["shared_dir"] = "shared_dir"
    dir: str
    """The directory every version is written into (one `v<N>` directory each); the agents read it."""
    keep_last: int = Field(3, ge=1)
    """Published versions kept; older ones are deleted."""


class NoSync(Section):
    transport: Literal["none"] = "none"
    """Nothing is published: the servers keep the weights they have."""


class _InMemory(Section):
    """What both in-memory paths share."""

    servers: list[str] = Field(default_factory=list)
    """Base URLs of the inference servers to send to (comma-separated or a list). Each version goes
    to those answering /health; one that is down is left out and joins at a later version."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype the parameters are sent in: the one the servers serve (bf16 on GPUs; fp32 on CPUs)."""
    bucket_mb: float = Field(64.0, gt=0)
    """Parameters per bucket (MB); each bucket is one request to every server and one checksum, and
    the unit the trainer gathers in: its sending rank holds at most two gathered buckets at a time."""
    timeout_s: float = Field(30.0, gt=0)
    """broadcast: deadline of the group (building it, each bucket's broadcast); a server that dies or
    stalls mid-broadcast is dropped after at most this, the group rebuilt, the version sent again.
    colocated: how long a server's answer to a version is awaited before it is reported failed."""
    disk_every: int = Field(10, ge=0)
    """Also write the version to disk / the object store every this many versions (late joiners and
    restarted servers catch up from the latest copy); 0: never."""
    disk_dir: str | None = None
    """Where the disk copy goes: this shared directory; unset: the WEIGHTS object store."""
    keep_last: int = Field(3, ge=1)
    """Disk copies kept; older ones are deleted."""
    background: bool = True
    """Send a version (one without a disk copy) while the trainer goes on with its next step; the
    next version waits for it. Off: the step waits until every server answered and the version was
    announced."""
    build_ahead_s: float = Field(300.0, ge=0)
    """At start the trainer prepares the path as soon as every server answers /health (waiting at most
    this long, then with those that do), while its engine is still being built: the first version
    does not wait for the rendezvous. 0: prepared when the first version is sent."""

    @field_validator("servers", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        if isinstance(v, str):
            return [s.strip() for s in v.split(",") if s.strip()]
        return v

    @field_validator("servers")
    @classmethod
    def _http(cls, v: list[str]) -> list[str]:
        for s in v:
            if not s.startswith(("http://", "https://")):
                raise ValueError(f"weights.servers: {s!r} is not an http(s):// base URL")
        return [s.rstrip("/") for s in v]

    @model_validator(mode="after")
    def _some_server(self) -> _InMemory:
        if not self.servers:
            raise ValueError("weights.servers is empty: an in-memory transport sends to the servers listed there")
        return self


class ColocatedSync(_InMemory):
    transport: Literal["colocated"] = "colocated"
    """The servers share this host: each version is copied once into shared memory (CUDA IPC handles
    on a GPU) and handed over with SGLang's /update_weights_from_tensor; nothing crosses a socket."""
    adopt: bool = True
    """Let a CPU server serve straight from the shared buffers (no copy at its end; the trainer keeps
    two sets of buffers and writes one only when no server reads it). Off: every server copies the
    tensors into its own memory, as SGLang does."""


class BroadcastSync(_InMemory):
    transport: Literal["broadcast"] = "broadcast"
    """Over a torch.distributed group (gloo) spanning the trainer and every server, for servers on any
    host (SGLang's /update_weights_from_distributed)."""
    master_address: str = "127.0.0.1"
    """The trainer's address as the servers reach it (the group's rendezvous host)."""
    checksum: bool = True
    """Send each bucket's checksum (XXH3-64, or CRC-32 where `xxhash` is not installed: the `checksum`
    field jetrl adds to SGLang's request) for the server to check; off only for a server that refuses
    unknown request fields (then nothing is checked)."""
    group_name: str = "jetrl-weights"
    """Name of the weight-update group on the servers."""


def _transport(value: Any) -> str:
    """The variant a value names; a mapping without `transport` is the default, `store`."""
    if isinstance(value, dict):
        return str(value.get("transport", "store"))
    return str(getattr(value, "transport", "store"))


WeightSyncSettings = Annotated[
    Annotated[StoreSync, Tag("store")] | Annotated[SharedDirSync, Tag("shared_dir")]
    | Annotated[ColocatedSync, Tag("colocated")] | Annotated[BroadcastSync, Tag("broadcast")]
    | Annotated[NoSync, Tag("none")],
    Discriminator(_transport),
]
"""One of the five paths, chosen by `transport`."""

VARIANTS: dict[str, type[Section]] = {"store": StoreSync, "shared_dir": SharedDirSync, "colocated": ColocatedSync,
                                      "broadcast": BroadcastSync, "none": NoSync}

LEGACY_KEYS = ("publish_weights", "weights_shared_dir", "weights_keep_last", "weights_broadcast")


def legacy_weights(data: Any, publish_default: bool = True) -> Any:
    """Settings spelled the earlier, flat way (`publish_weights`, `weights_shared_dir`,
    `weights_keep_last`, `weights_broadcast.*`) mapped onto `weights`, with a warning; both at once
    is an error. `publish_default`: what `publish_weights` was when not given (a replay's: false)."""
    if not isinstance(data, dict) or not any(k in data for k in LEGACY_KEYS):
        return data
    data = dict(data)
    old = {k: data.pop(k) for k in LEGACY_KEYS if k in data}
    if "weights" in data:
        raise ValueError(f"{', '.join(old)} and weights are both set: set weights only ({', '.join(old)} are its old spelling)")
    b = dict(old.get("weights_broadcast") or {})
    shared, keep = old.get("weights_shared_dir"), old.get("weights_keep_last")
    kept = {"keep_last": keep} if keep is not None else {}
    if not _truthy(old.get("publish_weights", publish_default)):
        new: dict[str, Any] = {"transport": "none"}
    elif _truthy(b.pop("enabled", False)):
        new = {"transport": b.pop("transport", "broadcast"), **b, **kept, **({"disk_dir": shared} if shared else {})}
        if new["transport"] == "colocated":
            for key in ("master_address", "checksum", "group_name"):  # the broadcast's own; colocated never read them
                new.pop(key, None)
        else:
            new.pop("adopt", None)
    elif shared:
        new = {"transport": "shared_dir", "dir": shared, **kept}
    else:
        new = {"transport": "store", **kept}
    data["weights"] = new
    warnings.warn(f"{', '.join(old)}: deprecated settings, read as weights={new} (see docs/weights.md)",
                  FutureWarning, stacklevel=2)
    return data


def _truthy(value: Any) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on") if isinstance(value, str) else bool(value)
