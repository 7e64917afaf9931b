"""Fast put/get of large files in the `WEIGHTS` JetStream object store.

nats-py's `ObjectStore.put` awaits the ack of every chunk and its `get` reads through an ordered push
consumer: ~200 MB/s up and ~60 MB/s down on this kind of machine, and getting into memory is quadratic.
Checkpoints are GBs, so these functions speak the same wire format (chunks on `$O.<bucket>.C.<nuid>`,
a JSON `ObjectInfo` rolled up on `$O.<bucket>.M.<b64 name>`, SHA-256 digest) with a window of
in-flight chunk publishes and a pull consumer read in byte-bounded batches, hashing and disk I/O in
a thread that overlaps the network. Objects stay readable by any NATS object store client, and
nats-py's own `get_info`/`delete`/`list` work on them.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    Header,
    ObjectInfo,
    ObjectMetaOptions,
    ObjectStoreConfig,
    StorageType,
)
from nats.js.errors import BadRequestError, BucketNotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore

CHUNK_SIZE = 1024 * 1024
"""1 MiB chunks: well under the server's max_payload, big enough that per-message cost is small."""
PUBLISH_WINDOW = 8
"""Chunk publishes in flight; window x chunk stays far below the stream's input buffer (notes: < 128 MB)."""
FETCH_BYTES = 16 * 1024 * 1024
"""Bytes asked for per pull `fetch`: bounded so a batch never trips the slow-consumer limit (64 MB)."""
ACK_TIMEOUT_S = 30.0


class ObjectStoreError(RuntimeError):
    """An object could not be written or read back intact."""


def _stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def _chunk_subject(bucket: str, nuid: str) -> str:
    return f"$O.{bucket}.C.{nuid}"


def digest_hex(info: ObjectInfo) -> str:
    """The object's SHA-256 as hex (the store keeps it as `SHA-256=<urlsafe base64>`)."""
    raw = (info.digest or "").split("=", 1)[-1]
    return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()


async def open_bucket(js: JetStreamContext, bucket: str) -> ObjectStore:
    """Open the bucket, creating it (file storage) if it does not exist; safe when several race."""
    try:
        return await js.object_store(bucket)
    except BucketNotFoundError:
        pass
    try:
        return await js.create_object_store(bucket, config=ObjectStoreConfig(storage=StorageType.FILE))
    except BadRequestError:  # someone else created it between our two calls
        return await js.object_store(bucket)


async def put_file(js: JetStreamContext, bucket: str, name: str, path: Path, chunk_size: int = CHUNK_SIZE) -> ObjectInfo:
    """Upload `path` as object `name`; returns its info (size, chunks, SHA-256 digest)."""
    loop = asyncio.get_running_loop()
    nuid = js._nc._nuid.next().decode()  # the same id source nats-py's own put uses
    subject = _chunk_subject(bucket, nuid)
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
                    await _settle(pending.popleft())
        while pending:
            await _settle(pending.popleft())
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
            ACK_TIMEOUT_S,
        )
    except BaseException:
        for fut in pending:
            fut.cancel()
        await js.purge_stream(_stream(bucket), subject=subject)
        raise
    if previous is not None and not previous.deleted and previous.nuid:
        await js.purge_stream(_stream(bucket), subject=_chunk_subject(bucket, previous.nuid))
    return info


async def _settle(fut: asyncio.Future) -> None:
    # nats-py never resolves a publish_async future the server answered 429 to: bound the wait.
    try:
        await asyncio.wait_for(fut, ACK_TIMEOUT_S)
    except TimeoutError as exc:
        raise ObjectStoreError(f"no ack for an object chunk within {ACK_TIMEOUT_S}s (stream full or server busy)") from exc


async def _info_or_none(js: JetStreamContext, bucket: str, name: str) -> ObjectInfo | None:
    try:
        return await ObjectStore(bucket, _stream(bucket), js).get_info(name)
    except ObjectNotFoundError:
        return None


async def get_file(js: JetStreamContext, bucket: str, name: str, dest: BinaryIO) -> tuple[ObjectInfo, str]:
    """Download object `name` into the open file `dest`; returns (info, sha256 hex of what was written).
    Raises `ObjectNotFoundError` if there is no such object, `ObjectStoreError` if it is incomplete."""
    info = await ObjectStore(bucket, _stream(bucket), js).get_info(name)
    sha = hashlib.sha256()
    if not info.size:
        return info, sha.hexdigest()
    chunk = (info.options.max_chunk_size if info.options and info.options.max_chunk_size else CHUNK_SIZE) or CHUNK_SIZE
    batch = max(1, FETCH_BYTES // chunk)
    sub = await js.pull_subscribe(
        _chunk_subject(bucket, info.nuid),
        stream=_stream(bucket),
        config=ConsumerConfig(
            ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, mem_storage=True, inactive_threshold=30.0
        ),
    )
    loop = asyncio.get_running_loop()

    def write(data: bytes) -> None:
        sha.update(data)
        dest.write(data)

    got = 0
    writing: asyncio.Future | None = None
    try:
        while got < (info.chunks or 0):
            try:
                msgs = await sub.fetch(min(batch, (info.chunks or 0) - got), timeout=ACK_TIMEOUT_S)
            except TimeoutError as exc:  # plain asyncio.TimeoutError also covers nats' own
                raise ObjectStoreError(f"{name}: chunks stopped arriving after {got}/{info.chunks}") from exc
            if writing is not None:
                await writing
            # The next fetch overlaps this batch's hashing and writing.
            writing = loop.run_in_executor(None, write, b"".join(m.data for m in msgs))
            got += len(msgs)
        if writing is not None:
            await writing
    finally:
        await sub.unsubscribe()
    return info, sha.hexdigest()


async def list_names(js: JetStreamContext, bucket: str) -> list[str]:
    """Names of the live objects in the bucket."""
    try:
        infos = await ObjectStore(bucket, _stream(bucket), js).list(ignore_deletes=True)
    except Exception as exc:  # nats-py raises a bare NotFoundError for an empty bucket
        if type(exc).__name__ in ("NotFoundError", "ObjectNotFoundError"):
            return []
        raise
    return [i.name for i in infos if not i.deleted]


async def delete(js: JetStreamContext, bucket: str, name: str) -> None:
    try:
        await ObjectStore(bucket, _stream(bucket), js).delete(name)
    except ObjectNotFoundError:
        pass
