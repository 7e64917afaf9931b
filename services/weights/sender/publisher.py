"""`WeightPublisher`: the trainer's rank 0 hands it a HF checkpoint directory after each step; it puts
the files in the `WEIGHTS` object store (or a shared directory) with a sha256 each, announces
`WeightsPublished` on the weight-sync subject and deletes versions older than the last `keep_last`.

Every NATS call of a publish (set-up, each file's upload, the announcement) rides out a server restart:
retried with capped backoff (`services.common.busretry`) for `bus_retry_timeout_s`, then
`BusUnavailable`."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path

from nats.aio.client import Client as NATS

from schemas.messages import WeightFile, WeightsPublished, encode
from schemas.subjects import WEIGHTS_BUCKET, Subjects
from services.common.bus import Bus
from services.common.busretry import with_retries
from services.common.logging import get_logger
from services.weights import objstore
from services.weights.announcements import ensure_weight_sync_stream, latest_published, next_epoch
from services.weights.files import (
    checkpoint_files,
    copy_hashed,
    file_uri,
    object_uri,
    parallel,
    remove_tree,
    same_filesystem,
    sha256_file,
    version_dirs,
    versions_to_drop,
)
from services.weights.trust import sign

log = get_logger("weights.publisher")


class WeightPublisher:
    def __init__(
        self,
        nc: NATS,
        run: str,
        *,
        shared_dir: str | Path | None = None,
        keep_last: int = 3,
        bucket: str = WEIGHTS_BUCKET,
        chunk_size: int = objstore.CHUNK_SIZE,
        bus_retry_timeout_s: float = 300.0,
        chunk_timeout_s: float = objstore.ACK_TIMEOUT_S,
        on_retry: Callable[[BaseException], None] | None = None,
        announce_key: bytes = b"",
        bus: Bus | None = None,
    ) -> None:
        """bus: the replicas, declare and retry policy of the stream and bucket it declares (the service's;
        None: a lone local server);
        bus_retry_timeout_s: how long a NATS call that fails the way a server restart looks is
        retried; chunk_timeout_s: longest wait for one object chunk's ack, per attempt; on_retry:
        called with the error before each retry (e.g. to count them in metrics); announce_key: signs
        every announcement (`trust.announce_key`; empty: unsigned)."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last}): the announced version must stay fetchable")
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = Subjects(run)
        self.run = run
        self.shared_dir = Path(shared_dir).resolve() if shared_dir else None
        self.keep_last = keep_last
        self.bucket = bucket
        self.chunk_size = chunk_size
        self.bus_retry_timeout_s = bus_retry_timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self.on_retry = on_retry
        self.announce_key = announce_key
        self.bus = bus if bus is not None else Bus()
        self._ready = False
        self.epoch: int | None = None
        """This trainer's epoch (`next_epoch`), read once at the first publish; every announcement carries it."""
        self._stored: dict[int, list[str]] | None = None
        """{version: object names} of this run in the bucket: listed at the first collection, then kept."""
        self._uploaded: dict[int, list[str]] = {}
        """Versions uploaded since the last collection."""

    async def _setup(self) -> None:
        if not self._ready:
            await ensure_weight_sync_stream(self.nc, self.bus_retry_timeout_s, self.on_retry, bus=self.bus)
            if self.shared_dir is None:
                await objstore.open_bucket(self.js, self.bucket, replicas=self.bus.replicas, declare=self.bus.declare,
                                           budget_s=self.bus_retry_timeout_s, on_retry=self.on_retry, policy=self.bus.retry)
            if self.epoch is None:
                self.epoch = await with_retries("read the last announcement", lambda: next_epoch(self.nc, self.run),
                                                self.bus_retry_timeout_s, self.on_retry, policy=self.bus.retry)
            self._ready = True

    async def publish_dir(self, version: int, step: int, hf_dir: str | Path, *, consume: bool = False) -> WeightsPublished:
        """Upload (or copy) the checkpoint at `hf_dir` as `version`, announce it, drop old versions.

        consume: the caller hands `hf_dir` over and will not touch it again (the trainer writes a
        fresh one per version). With a shared directory on the same filesystem it is then moved there
        instead of copied."""
        await self._setup()
        hf_dir = Path(hf_dir)
        files = checkpoint_files(hf_dir)
        t0 = time.perf_counter()
        if self.shared_dir is not None:
            uri, entries = await self._copy_to_shared(version, hf_dir, files, consume)
        else:
            uri, entries = await self._upload(version, hf_dir, files)
        upload_s = time.perf_counter() - t0
        msg = sign(WeightsPublished(run=self.run, version=version, uri=uri, files=entries, step=step, epoch=self.epoch or 0),
                   self.announce_key)
        data = encode(msg)
        # A repeat after a lost ack is harmless: agents skip the version they already hold.
        await with_retries(f"announce weights v{version}", lambda: self.js.publish(self.subjects.weights_published, data),
                           self.bus_retry_timeout_s, self.on_retry, policy=self.bus.retry)
        total = sum(f.size for f in entries)
        log.info("weights published", version=version, step=step, uri=uri, bytes=total, seconds=round(upload_s, 3))
        await self._collect_garbage(version)
        return msg

    async def latest(self) -> WeightsPublished | None:
        await self._setup()
        return await latest_published(self.nc, self.run)

    async def _upload(self, version: int, hf_dir: Path, files: list[Path]) -> tuple[str, list[WeightFile]]:
        prefix = f"{self.run}/v{version}"
        entries = []
        for path in files:
            name = path.relative_to(hf_dir).as_posix()
            info = await objstore.put_file(self.js, self.bucket, f"{prefix}/{name}", path, self.chunk_size,
                                           timeout_s=self.chunk_timeout_s, retry_s=self.bus_retry_timeout_s, on_retry=self.on_retry,
                                           policy=self.bus.retry)
            entries.append(WeightFile(name=name, sha256=objstore.digest_hex(info), size=int(info.size or 0)))
            self._uploaded.setdefault(version, []).append(f"{prefix}/{name}")
        return object_uri(self.bucket, prefix), entries

    async def _copy_to_shared(
        self, version: int, hf_dir: Path, files: list[Path], consume: bool
    ) -> tuple[str, list[WeightFile]]:
        assert self.shared_dir is not None
        final = self.shared_dir / f"v{version}"
        # Written under a hidden name and renamed, so an agent never sees a half-copied version.
        partial = self.shared_dir / f".v{version}.partial"
        remove_tree(partial)
        names = [path.relative_to(hf_dir).as_posix() for path in files]

        def move_and_hash() -> list[WeightFile]:
            partial.parent.mkdir(parents=True, exist_ok=True)
            hf_dir.rename(partial)
            digests = parallel(sha256_file, [partial / name for name in names], cost=lambda p: p.stat().st_size)
            return [WeightFile(name=n, sha256=d, size=(partial / n).stat().st_size) for n, d in zip(names, digests, strict=True)]

        def copy_all() -> list[WeightFile]:
            return parallel(lambda pair: copy_hashed(pair[0], partial / pair[1], pair[1]), list(zip(files, names, strict=True)),
                            cost=lambda pair: pair[0].stat().st_size)

        def publish() -> list[WeightFile]:
            move = consume and same_filesystem(hf_dir, self.shared_dir)  # type: ignore[arg-type]
            entries = move_and_hash() if move else copy_all()
            remove_tree(final)
            partial.rename(final)
            return entries

        entries = await asyncio.to_thread(publish)
        return file_uri(final), entries

    async def _collect_garbage(self, current: int) -> None:
        """Keep the newest `keep_last` versions (always the one just announced); failures only log,
        since a stale version left behind costs space, not correctness."""
        try:
            if self.shared_dir is not None:
                dirs = version_dirs(self.shared_dir)
                for v in versions_to_drop(set(dirs), self.keep_last, protect={current}):
                    await asyncio.to_thread(remove_tree, dirs[v])
                    log.info("old weights deleted", version=v, path=str(dirs[v]))
                return
            if self._stored is None:
                # Listed once (it reads every object's record through a consumer), then kept up to date.
                self._stored = {}
                pattern = re.compile(rf"^{re.escape(self.run)}/v(\d+)/")
                for name in await objstore.list_names(self.js, self.bucket):
                    if m := pattern.match(name):
                        self._stored.setdefault(int(m.group(1)), []).append(name)
            for v, names in self._uploaded.items():
                have = self._stored.setdefault(v, [])
                have.extend(n for n in names if n not in have)
            self._uploaded.clear()
            for v in versions_to_drop(set(self._stored), self.keep_last, protect={current}):
                for name in list(self._stored[v]):
                    await objstore.delete(self.js, self.bucket, name)
                    self._stored[v].remove(name)
                del self._stored[v]
                log.info("old weights deleted", version=v)
        except Exception as exc:
            log.warning("deleting old weights failed", error=repr(exc))
