"""`VersionSender`: how a weight version reaches the inference servers in memory.

`BroadcastPublisher` (reports, announcement, disk copy every `disk_every` versions, the background
and streamed publish) drives one of these per trainer, chosen by `weights.transport`:
- `WeightBroadcaster` (`broadcast.py`, transport `broadcast`): a torch.distributed group (gloo)
  spanning the trainer's sending rank and every server, SGLang's `/update_weights_from_distributed`;
  for servers on other hosts.
- `ColocatedSender` (`colocated.py`, transport `colocated`): trainer and servers share a host; each
  version is copied once into shared memory (CUDA IPC on a GPU) and handed over by handle with
  SGLang's `/update_weights_from_tensor`.

The loop it serves (one version at a time, in order):

    result = await sender.send(version, source)   # source: the gathered buckets, as they come
    # result.loaded / result.failed per server; then the publisher reports and announces
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from services.weights.sender.bucket_stream import BucketSource
    from services.weights.sender.results import VersionResult


class VersionSender(Protocol):
    transport: Literal["broadcast", "colocated"]
    """What `WeightsPublished.transport` and the reports say."""
    dtype_name: str
    """The dtype the parameters are sent in."""
    bucket_bytes: int
    """Bytes per bucket: the unit the trainer gathers in."""

    @property
    def address(self) -> str:
        """Where the version went from (`WeightsPublished.group`)."""
        ...

    @property
    def members(self) -> list[str]:
        """The servers the last version reached."""
        ...

    async def send(self, version: int, source: BucketSource) -> VersionResult:
        """Send a version's buckets as `source` gives them; finishes the source."""
        ...

    async def send_version(self, version: int, state: dict[str, torch.Tensor]) -> VersionResult:
        """Send a version gathered in full."""
        ...

    async def build_ahead(self, wait_s: float) -> list[str]:
        """Prepare before the first version (the broadcast builds its group); returns the members."""
        ...

    async def aclose(self) -> None: ...
