"""Fast put/get of large files in the `WEIGHTS` JetStream object store.

nats-py's `ObjectStore.put` awaits the ack of every chunk and its `get` reads through an ordered push
consumer: ~200 MB/s up and ~60 MB/s down on this kind of machine, and getting into memory is quadratic.
Checkpoints are GBs, so these functions speak the same wire format (chunks on `$O.<bucket>.C.<nuid>`,
a JSON `ObjectInfo` rolled up on `$O.<bucket>.M.<b64 name>`, SHA-256 digest) with a window of
in-flight chunk publishes and a pull consumer read in byte-bounded batches, hashing and disk I/O in
a thread that overlaps the network. Objects stay readable by any NATS object store client, and
nats-py's own `get_info`/`delete`/`list` work on them.

Both ride out a nats-server restart (`services.common.busretry`): an upload starts its file again
under a fresh id; reading is in `objread`.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import json
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from nats.js import JetStreamContext
from nats.js.api import (
    Header,
    ObjectInfo,
    ObjectMetaOptions,
    ObjectStoreConfig,
    StorageType,
)
from nats.js.errors import BadRequestError, BucketNotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

from services.common.bus import DECLARE_BUDGET_S, js_api_call, not_initialized
from services.common.busretry import RetryPolicy, with_retries
from services.common.logging import get_logger

CHUNK_SIZE = 1024 * 1024
"""1 MiB chunks: well under the server's max_payload, big enough that per-message cost is small."""
PUBLISH_WINDOW = 8
"""Chunk publishes in flight; window x chunk stays far below the stream's input buffer (notes: < 128 MB)."""
FETCH_BYTES = 16 * 1024 * 1024
"""Bytes asked for per pull `fetch`: bounded so a batch never trips the slow-consumer limit (64 MB)."""
ACK_TIMEOUT_S = 30.0
"""Default longest wait for one chunk's ack (upload) or one batch of chunks (download), per attempt."""
CLEANUP_TIMEOUT_S = 5.0
"""Longest wait for a consumer delete or a purge of abandoned chunks, which are best effort."""

log = get_logger("weights.objstore")


class ObjectStoreError(RuntimeError):
    """An object could not be written or read back intact."""


class ChunkTimeout(ObjectStoreError, TimeoutError):
    """A chunk was not acknowledged, or not delivered, in time: a timeout like any other, so retried as one."""


def stream_name(bucket: str) -> str:
    return f"OBJ_{bucket}"


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def chunk_subject(bucket: str, nuid: str) -> str:
    return f"$O.{bucket}.C.{nuid}"


def digest_hex(info: ObjectInfo) -> str:
    """The object's SHA-256 as hex (the store keeps it as `SHA-256=<urlsafe base64>`)."""
    raw = (info.digest or "").split("=", 1)[-1]
    return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()


async def open_bucket(js: JetStreamContext, bucket: str, *, replicas: int = 1, declare: bool = True,
                      budget_s: float = DECLARE_BUDGET_S, on_retry: Callable[[BaseException], None] | None = None,
                      policy: RetryPolicy) -> ObjectStore:
    """Open the bucket, creating it (file storage, `replicas`: the service's `nats_replicas`, from its
    `Bus`) if it does not exist; safe when several race. `declare` False (`bus_declare=false`)
    only opens it: a missing bucket is `BusNotInitialized` naming `jetrl bus init`. A bus that does not
    answer yet (a cluster still electing) is waited out for `budget_s`, as `declare_streams` waits it out
    (`policy`: the service's, `Bus.retry`)."""

    async def call(what: str, fn: Callable[[], Awaitable[ObjectStore]]) -> ObjectStore:
        return await js_api_call(f"bucket {bucket}: {what}", fn, budget_s, on_retry, policy=policy)

    try:
        return await call("open", functools.partial(js.object_store, bucket))
    except BucketNotFoundError:
        if not declare:
            raise not_initialized(f"object store bucket {bucket}") from None
    config = ObjectStoreConfig(storage=StorageType.FILE, replicas=replicas)
    try:
        return await call("create", functools.partial(js.create_object_store, bucket, config=config))
    except BadRequestError:  # someone else created it between our two calls
        return await call("open", functools.partial(js.object_store, bucket))


async def put_file(
    js: JetStreamContext,
    bucket: str,
    name: str,
    path: Path,
    chunk_size: int = CHUNK_SIZE,
    *,
    timeout_s: float = ACK_TIMEOUT_S,
    retry_s: float = 0.0,
    on_retry: Callable[[BaseException], None] | None = None,
    policy: RetryPolicy,
) -> ObjectInfo:
    """Upload `path` as object `name`; returns its info (size, chunks, SHA-256 digest).

    timeout_s: longest wait for one chunk's ack. An attempt that fails the way a NATS restart looks
    (`busretry.retryable`, a chunk never acked included) is started again from the first chunk under a
    fresh id, with capped backoff, until `retry_s` has passed (then `BusUnavailable`); the chunks of a
    failed attempt are purged as soon as the server answers again. `policy`: the service's (`Bus.retry`)."""
    abandoned: list[str] = []

    async def attempt() -> ObjectInfo:
        nuid = js._nc._nuid.next().decode()  # the same id source nats-py's own put uses
        try:
            return await _put_once(js, bucket, name, path, chunk_size, nuid, timeout_s)
        except BaseException:
            if not await _purge_chunks(js, bucket, nuid):
                abandoned.append(nuid)
            raise

    info = await with_retries(f"upload {bucket}/{name}", attempt, retry_s, on_retry, policy=policy)
    for old in abandoned:  # left by attempts made while the server was away
        await _purge_chunks(js, bucket, old)
    return info


async def _put_once(
    js: JetStreamContext, bucket: str, name: str, path: Path, chunk_size: int, nuid: str, timeout_s: float
) -> ObjectInfo:
    loop = asyncio.get_running_loop()
    subject = chunk_subject(bucket, nuid)
    sha = hashlib.sha256()
    pending: deque[asyncio.Future] = deque()
    size = chunks = 0

    def read(f: BinaryIO) -> bytes:
        data = f.read(chunk_size)
        sha.update(data)  # in the thread: hashlib releases the GIL on large buffers
        return data

    try:
        with await asyncio.to_thread(open, path, "rb", buffering=0) as f:
            while data := await loop.run_in_executor(None, read, f):
                pending.append(await js.publish_async(subject, data))
                size += len(data)
                chunks += 1
                if len(pending) >= PUBLISH_WINDOW:
                    await _settle(pending.popleft(), timeout_s)
        while pending:
            await _settle(pending.popleft(), timeout_s)
    finally:
        for fut in pending:
            fut.cancel()
    info = ObjectInfo(
        name=name,
        bucket=bucket,
        nuid=nuid,
        size=size,
        chunks=chunks,
        mtime=datetime.now(UTC).isoformat(),
        digest="SHA-256=" + base64.urlsafe_b64encode(sha.digest()).decode(),
        options=ObjectMetaOptions(max_chunk_size=chunk_size),
    )
    previous = await _info_or_none(js, bucket, name)
    await asyncio.wait_for(
        js.publish(_meta_subject(bucket, name), json.dumps(info.as_dict()).encode(), headers={Header.ROLLUP: "sub"}),
        timeout_s,
    )
    if previous is not None and not previous.deleted and previous.nuid and previous.nuid != nuid:
        await _purge_chunks(js, bucket, previous.nuid)
    return info


async def _settle(fut: asyncio.Future, timeout_s: float) -> None:
    # nats-py never resolves a publish_async future the server answered 429 to, nor one sent while
    # the server was away: bound the wait.
    try:
        await asyncio.wait_for(fut, timeout_s)
    except TimeoutError as exc:
        raise ChunkTimeout(f"no ack for an object chunk within {timeout_s}s (server away, stream full or busy)") from exc


async def _purge_chunks(js: JetStreamContext, bucket: str, nuid: str) -> bool:
    """Best effort, never raises (it runs in cleanups): False if the server did not answer."""
    try:
        await asyncio.shield(asyncio.wait_for(js.purge_stream(stream_name(bucket), subject=chunk_subject(bucket, nuid)), CLEANUP_TIMEOUT_S))
        return True
    except Exception as exc:
        log.warning("purging an object's chunks failed; retried after the next upload", nuid=nuid, error=repr(exc))
        return False


async def _info_or_none(js: JetStreamContext, bucket: str, name: str) -> ObjectInfo | None:
    try:
        return await ObjectStore(bucket, stream_name(bucket), js).get_info(name)
    except ObjectNotFoundError:
        return None


async def list_names(js: JetStreamContext, bucket: str) -> list[str]:
    """Names of the live objects in the bucket."""
    try:
        infos = await ObjectStore(bucket, stream_name(bucket), js).list(ignore_deletes=True)
    except Exception as exc:  # nats-py raises a bare NotFoundError for an empty bucket
        if type(exc).__name__ in ("NotFoundError", "ObjectNotFoundError"):
            return []
        raise
    return [i.name for i in infos if not i.deleted]


async def delete(js: JetStreamContext, bucket: str, name: str) -> None:
    try:
        await ObjectStore(bucket, stream_name(bucket), js).delete(name)
    except ObjectNotFoundError:
        pass
