"""Settings of the in-memory weight path (the trainer's `weights_broadcast` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from services.common.settings import Section


class BroadcastSettings(Section):
    enabled: bool = False
    """Send each version to the servers in memory (`transport`) instead of writing it to disk every
    step; the disk / object-store copy is then written every `disk_every` versions."""
    transport: Literal["broadcast", "colocated"] = "broadcast"
    """`broadcast`: over a torch.distributed group (gloo), for servers on any host. `colocated`: the
    servers share this host: each version is copied once into shared memory (CUDA IPC handles on a
    GPU) and handed over with SGLang's /update_weights_from_tensor; nothing crosses a socket."""
    adopt: bool = True
    """colocated: let a CPU server serve straight from the shared buffers (no copy at its end; the
    trainer keeps two sets of buffers and writes one only when no server reads it). Off: every server
    copies the tensors into its own memory, as SGLang does."""
    servers: list[str] = Field(default_factory=list)
    """Base URLs of the inference servers to send to (comma-separated or a list). Each version goes
    to those answering /health; one that is down is left out and joins at a later version."""
    master_address: str = "127.0.0.1"
    """broadcast: the trainer's address as the servers reach it (the group's rendezvous host)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype the parameters are sent in: the one the servers serve (bf16 on GPUs; fp32 on CPUs)."""
    bucket_mb: float = Field(64.0, gt=0)
    """Parameters per bucket (MB); each bucket is one request to every server and one checksum, and
    the unit the trainer gathers in: its sending rank holds at most two gathered buckets at a time."""
    timeout_s: float = Field(30.0, gt=0)
    """Deadline of the group: building it, and each bucket's broadcast. A server that dies or stalls
    mid-broadcast is dropped after at most this, the group rebuilt, and the version sent again.
    colocated: how long a server's answer to a version is awaited before it is reported failed."""
    disk_every: int = Field(10, ge=0)
    """Also write the version to disk / the object store every this many versions (late joiners and
    restarted servers catch up from the latest copy); 0: never."""
    checksum: bool = True
    """Send each bucket's checksum (XXH3-64, or CRC-32 where `xxhash` is not installed: the `checksum`
    field jetrl adds to SGLang's request) for the server to check; off only for a server that refuses
    unknown request fields (then nothing is checked)."""
    background: bool = True
    """Send a version (one without a disk copy) while the trainer goes on with its next step; the
    next version waits for it. Off: the step waits until every server answered and the version was
    announced."""
    build_ahead_s: float = Field(300.0, ge=0)
    """At start the trainer builds the group as soon as every server answers /health (waiting at most
    this long, then with those that do), while its engine is still being built: the first version
    does not wait for the rendezvous. 0: the group is built when the first version is sent."""
    group_name: str = "jetrl-weights"
    """Name of the weight-update group on the servers."""

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
                raise ValueError(f"weights_broadcast.servers: {s!r} is not an http(s):// base URL")
        return [s.rstrip("/") for s in v]
