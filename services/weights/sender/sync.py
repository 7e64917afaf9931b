"""`WeightSync`: how the trainer hands each weight version on, whatever the transport.

The loop it serves, once per version (`services/trainer/loop.py`):

    ship = sync.begin(version, staging)   # before the training call: what the call must produce
    try:
        res = train(..., weights_dir=ship.weights_dir, weights_state=ship.want_state,
                    weights_stream=ship.stream, sink=ship.sink)
    except BaseException as exc:
        ship.abandon(exc)                 # nothing more of this version comes
        raise
    await ship.landed(res.weights_dir, res.state)  # at once: it takes over the checkpoint directory
    ...                                   # the step is committed and its messages acknowledged
    await ship.finish(metrics)            # published (or sending in the background), staging removed

and, outside the steps: `publish_dir` (a run's base weights at a fresh start or a catch-up),
`prepare` (at start, before the first version: the broadcast builds its group), `aclose`.

Implementations: `NoWeights` (transport none), `DiskWeights` (store, shared_dir: one checkpoint
directory per version through `WeightPublisher`), `MemoryWeights` (`memory.py`: colocated,
broadcast). `factory.py` builds the one the settings name.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from services.common.busretry import RetryPolicy, with_retries
from services.common.logging import get_logger

if TYPE_CHECKING:
    import torch

    from services.common.metrics import MetricsPublisher
    from services.weights.sender.bucket_stream import BucketStream, StreamSpec

log = get_logger("weights.sync")

PublishDir = Callable[[int, int, Path], Awaitable[Any]]
"""`publish(version, step, hf_dir)`: e.g. `WeightPublisher.publish_dir` with `consume=True`; it may
take `hf_dir` over (the trainer removes whatever is left of it afterwards)."""


class Shipment:
    """One version on its way. This base ships nothing (transport none)."""

    weights_dir: str | None = None
    """The training call writes the version's HF checkpoint here (a disk version)."""
    want_state: bool = False
    """The training call returns the full gathered state (in memory, not streamed)."""
    stream: StreamSpec | None = None
    """The training call gathers the version bucket by bucket into `sink` (rank 0's stream)."""
    sink: BucketStream | None = None

    def abandon(self, error: BaseException) -> None:
        """The training call failed: nothing of this version comes."""

    async def landed(self, hf_dir: Path | None, state: dict[str, torch.Tensor] | None) -> None:
        """Right after the training call: what it produced (the checkpoint directory, the state)."""

    async def finish(self, metrics: MetricsPublisher | None) -> None:
        """After the step is committed: publish the version (or start sending it in the background),
        then remove what the call wrote; what cannot be published is counted in `metrics`."""


class WeightSync(Protocol):
    publishes: bool
    """Whether versions reach the servers at all (the feeder gates prompts on announced versions)."""

    def begin(self, version: int, staging: Path) -> Shipment:
        """Before the training call of `version`; `staging`: where a checkpoint directory may go."""
        ...

    async def publish_dir(self, version: int, step: int, hf_dir: Path) -> None:
        """Publish a checkpoint directory outside the steps (a run's base weights); may take it over."""
        ...

    async def prepare(self) -> None:
        """At start, before the first version (the broadcast builds its group); never raises."""
        ...

    async def aclose(self) -> None:
        """The last version still goes out; then the transport is closed."""
        ...


class NoWeights:
    """transport none: no version is published."""

    publishes = False

    def begin(self, version: int, staging: Path) -> Shipment:
        return Shipment()

    async def publish_dir(self, version: int, step: int, hf_dir: Path) -> None:
        raise RuntimeError("weights.transport is none: nothing is published")

    async def prepare(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


class DiskWeights:
    """store / shared_dir: each version's HF checkpoint through `publish` (a `WeightPublisher`)."""

    publishes = True

    def __init__(self, publish: PublishDir, *, retry_s: float = 300.0, retry: RetryPolicy | None = None) -> None:
        self.publish = publish
        self.retry_s = retry_s
        """How long a publish is retried through a NATS outage (the trainer's bus_retry_timeout_s)."""
        self.retry = retry if retry is not None else RetryPolicy()
        """The trainer's retry policy (`Bus.retry`; None: a fresh one)."""

    def begin(self, version: int, staging: Path) -> Shipment:
        return _DiskShipment(self, version, staging / f"v{version}")

    async def publish_dir(self, version: int, step: int, hf_dir: Path) -> None:
        await self.publish(version, step, hf_dir)

    async def prepare(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


class _DiskShipment(Shipment):
    def __init__(self, owner: DiskWeights, version: int, weights_dir: Path) -> None:
        self.owner, self.version, self.weights_dir = owner, version, str(weights_dir)
        self.written: Path | None = None

    async def landed(self, hf_dir: Path | None, state: dict[str, torch.Tensor] | None) -> None:
        self.written = hf_dir

    async def finish(self, metrics: MetricsPublisher | None) -> None:
        if self.written is None:
            return
        try:
            await self._publish(self.written, metrics)
        finally:
            await asyncio.to_thread(shutil.rmtree, self.written, True)

    async def _publish(self, hf_dir: Path, metrics: MetricsPublisher | None) -> None:
        publish, version = self.owner.publish, self.version
        taken = False

        async def attempt() -> Any:
            nonlocal taken
            if not await asyncio.to_thread(Path(hf_dir).is_dir):
                taken = True
                return None
            return await publish(version, version, hf_dir)

        await with_retries(f"publish weights v{version}", attempt, self.owner.retry_s, policy=self.owner.retry)
        if taken:
            # A shared directory on our filesystem: the failed attempt moved the weights there before
            # its announcement failed, so this version cannot be published again. Skipping it costs
            # the servers one version; exiting would stop the run over a bus that is merely away.
            log.warning("weights version not announced; the next step publishes the next one", version=version)
            if metrics is not None:
                metrics.count("weights_versions_skipped")
