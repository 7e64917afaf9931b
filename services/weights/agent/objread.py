"""Reading an object of the `WEIGHTS` store (`objstore` has the wire format and the writing side).

A pull consumer on the object's chunk subject is read in byte-bounded batches, the next batch
arriving while a thread hashes and writes the last. A download rides out a nats-server restart
(`services.common.busretry`): it resumes after its last chunk written, through a new consumer. It
holds one consumer at a time and deletes it when done, so a reader never piles them up however many
files it reads (nats-server refuses a stream's 1,001st).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable
from typing import BinaryIO

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, ObjectInfo
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from services.common.busretry import RetryPolicy, with_retries
from services.common.logging import get_logger
from services.weights.objstore import (
    ACK_TIMEOUT_S,
    CHUNK_SIZE,
    CLEANUP_TIMEOUT_S,
    FETCH_BYTES,
    ChunkTimeout,
    ObjectStoreError,
    chunk_subject,
    stream_name,
)

log = get_logger("weights.objread")


async def get_file(
    js: JetStreamContext,
    bucket: str,
    name: str,
    dest: BinaryIO,
    *,
    timeout_s: float = ACK_TIMEOUT_S,
    retry_s: float = 0.0,
    on_retry: Callable[[BaseException], None] | None = None,
    policy: RetryPolicy,
) -> tuple[ObjectInfo, str]:
    """Download object `name` into the open file `dest`; returns (info, sha256 hex of what was written).
    Raises `ObjectNotFoundError` if there is no such object, `ObjectStoreError` if it changed while
    being read.

    Each attempt reads through one consumer that is deleted when the attempt ends (the server also
    drops it after `inactive_threshold` if that delete is lost), so a reader holds at most one. An
    attempt that fails the way a NATS restart looks (a batch not delivered within `timeout_s`
    included) is resumed after the last chunk written, with capped backoff, until `retry_s` has passed
    (then `BusUnavailable`; `policy`: the service's, `Bus.retry`)."""
    store = ObjectStore(bucket, stream_name(bucket), js)
    reader: _Reader | None = None

    async def attempt() -> _Reader:
        nonlocal reader
        info = await store.get_info(name)
        if reader is None:
            reader = _Reader(info, dest)
        elif info.nuid != reader.info.nuid:
            raise ObjectStoreError(f"{name}: replaced while it was being read")
        await reader.read(js, bucket, timeout_s)
        return reader

    done = await with_retries(f"download {bucket}/{name}", attempt, retry_s, on_retry, policy=policy)
    return done.info, done.sha.hexdigest()


class _Reader:
    """The chunks of one object written to `dest` in order; `read` resumes after the last one written."""

    def __init__(self, info: ObjectInfo, dest: BinaryIO) -> None:
        self.info, self.dest = info, dest
        self.sha = hashlib.sha256()
        self.got = 0
        self.next_seq: int | None = None  # stream sequence to resume from

    def _write(self, data: bytes) -> None:
        self.sha.update(data)
        self.dest.write(data)

    async def read(self, js: JetStreamContext, bucket: str, timeout_s: float) -> None:
        total = self.info.chunks or 0
        if not self.info.size or self.got >= total:
            return
        opts = self.info.options
        chunk = (opts.max_chunk_size if opts and opts.max_chunk_size else CHUNK_SIZE) or CHUNK_SIZE
        batch = max(1, FETCH_BYTES // chunk)
        stream, consumer = stream_name(bucket), js._nc._nuid.next().decode()
        # Named before it is created, so that it is deleted even if this is cancelled mid-request.
        config = ConsumerConfig(
            name=consumer,
            filter_subject=chunk_subject(bucket, self.info.nuid or ""),
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL if self.next_seq is None else DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.next_seq,
            mem_storage=True,
            inactive_threshold=max(2 * timeout_s, 10.0),
        )
        loop = asyncio.get_running_loop()
        writing: asyncio.Future | None = None
        try:
            await js.add_consumer(stream, config=config)
            sub = await js.pull_subscribe_bind(consumer, stream=stream)
            try:
                while self.got < total:
                    try:
                        msgs = await sub.fetch(min(batch, total - self.got), timeout=timeout_s)
                    except TimeoutError as exc:  # plain asyncio.TimeoutError also covers nats' own
                        raise ChunkTimeout(f"{self.info.name}: chunks stopped arriving after {self.got}/{total}") from exc
                    if writing is not None:
                        await writing
                    # The next fetch overlaps this batch's hashing and writing.
                    writing = loop.run_in_executor(None, self._write, b"".join(m.data for m in msgs))
                    self.got += len(msgs)
                    self.next_seq = msgs[-1].metadata.sequence.stream + 1
            finally:
                if writing is not None:
                    await writing  # a retry appends after it
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        finally:
            await _delete_consumer(js, stream, consumer)


async def _delete_consumer(js: JetStreamContext, stream: str, consumer: str) -> None:
    # Shielded: a cancelled (superseded) fetch still deletes its consumer; never raises (a cleanup).
    try:
        await asyncio.shield(asyncio.wait_for(js.delete_consumer(stream, consumer), CLEANUP_TIMEOUT_S))
    except NotFoundError:
        pass  # its creation never reached the server
    except Exception as exc:
        log.warning("deleting a fetch consumer failed; the server drops it when inactive", consumer=consumer, error=repr(exc))
