"""Agent side: turn an announcement into a verified local directory the server can load.

Object store versions are downloaded into `<cache_dir>/v<N>` (through a hidden partial directory, so a
half-fetched version is never loaded); shared-directory versions are verified in place. Every file's
size and sha256 must match the announcement. A download rides out a NATS restart: each file is resumed
after its last chunk written, retried with capped backoff for `retry_s`; only then, or on an error no
retry can help, is it a `FetchError` (never a bus error escaping to the caller).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import ObjectNotFoundError

from schemas.messages import WeightFile, WeightsPublished
from services.common.busretry import BusUnavailable, RetryPolicy
from services.weights import objstore
from services.weights.agent import objread
from services.weights.files import ChecksumError, parallel, parse_uri, remove_tree, safe_name, verify_file


class FetchError(RuntimeError):
    """The announced version cannot be used: a file is missing, truncated or has the wrong sha256."""


@dataclass(frozen=True)
class Retry:
    """How a download waits through a NATS outage (`objread.get_file`)."""

    timeout_s: float = objstore.ACK_TIMEOUT_S
    """Longest wait for one batch of chunks, per attempt."""
    retry_s: float = 0.0
    """How long retryable failures are retried before the fetch fails."""
    on_retry: Callable[[BaseException], None] | None = None
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    """The service's (`Bus.retry`)."""


async def fetch_version(js: JetStreamContext, msg: WeightsPublished, cache_dir: Path, retry: Retry | None = None) -> Path:
    """Return a local directory holding exactly the announced files of `msg` (`retry` None: no retries)."""
    retry = retry if retry is not None else Retry()
    if not msg.files:
        raise FetchError(f"v{msg.version}: the announcement lists no files")
    where = parse_uri(msg.uri)
    if where.scheme == "file":
        assert where.path is not None
        await _verify_in_place(where.path, msg)
        return where.path
    return await _download(js, where.bucket, where.prefix, msg, cache_dir, retry)


async def _verify_in_place(root: Path, msg: WeightsPublished) -> None:
    def verify(f: WeightFile) -> None:
        base = root.resolve()
        path = root / safe_name(f.name)
        if not path.resolve().is_relative_to(base):  # a symbolic link out of the version directory
            raise ValueError(f"file {f.name!r} leads out of the version directory")
        verify_file(path, f)

    try:
        await asyncio.to_thread(parallel, verify, list(msg.files), lambda f: f.size)
    except (ChecksumError, FileNotFoundError, ValueError) as exc:
        raise FetchError(f"v{msg.version}: {exc}") from exc


async def _download(js: JetStreamContext, bucket: str, prefix: str, msg: WeightsPublished, cache_dir: Path, retry: Retry) -> Path:
    await asyncio.to_thread(cache_dir.mkdir, parents=True, exist_ok=True)
    final = cache_dir / f"v{msg.version}"
    partial = cache_dir / f".v{msg.version}.{uuid.uuid4().hex[:8]}.partial"
    try:
        for f in msg.files:
            try:
                dest = partial / safe_name(f.name)
            except ValueError as exc:
                raise FetchError(f"v{msg.version}: {exc}") from exc
            await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
            try:
                # opened in a thread too; objread.get_file hashes and writes in executor threads
                with await asyncio.to_thread(open, dest, "wb") as out:
                    info, digest = await objread.get_file(js, bucket, f"{prefix}/{f.name}", out, timeout_s=retry.timeout_s,
                                                           retry_s=retry.retry_s, on_retry=retry.on_retry, policy=retry.policy)
            except ObjectNotFoundError as exc:  # a deleted object too (get_info says so)
                raise FetchError(f"v{msg.version}: {f.name}: missing from {bucket}/{prefix}") from exc
            except (objstore.ObjectStoreError, BusUnavailable, nats.errors.Error) as exc:
                raise FetchError(f"v{msg.version}: {f.name}: {exc!r}") from exc
            if info.size != f.size:
                raise FetchError(f"v{msg.version}: {f.name}: size {info.size} != announced {f.size}")
            if digest != f.sha256:
                raise FetchError(f"v{msg.version}: {f.name}: sha256 {digest[:12]}... != announced {f.sha256[:12]}...")
        # a stale copy of this version and a failed fetch can each be gigabytes: delete them off the loop
        await asyncio.to_thread(remove_tree, final)
        partial.rename(final)
        return final
    finally:
        await asyncio.to_thread(remove_tree, partial)  # a no-op after the rename; cleans up a failed or superseded fetch
