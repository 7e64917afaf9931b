"""Reading a recorded range of a run's TRAJECTORIES stream, in stream order.

An ordered pull consumer: ephemeral, no acks, filtered on the run's trajectory subject(s), started at
a sequence or a time, read one pull request per batch (`pull.Puller`). The reader checks that
consumer sequences are contiguous; on a gap (a lost pull reply, a reconnect) or a vanished consumer
it recreates the consumer right after the last sequence it yielded, so the range is read exactly
once, in order. It works while a live run is still writing: the range ends at the last message
present at the start unless `follow` is set; that message is asked of the stream's leader, as a
consumer (or a replica answering while its stream has no leader) may see an older copy.
`batches()` gives the range as each pull brought it (replay decodes a pull's groups together).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RawStreamMsg

from schemas.subjects import TRAJECTORIES_STREAM, Subjects
from schemas.trajectory import DecodedGroup
from services.common.bus import js_api_call
from services.common.busretry import RetryPolicy
from services.common.consumers import add_consumer
from services.common.logging import get_logger
from services.replay.pull import ConsumerLost, Puller
from services.replay.settings import RangeSettings

log = get_logger("replay.reader")

# A training step can take long between two pulls; the server drops an ephemeral consumer idle longer.
_INACTIVE_S = 3600.0


@dataclass(frozen=True)
class Record:
    """One recorded trajectory message (or a row group of a Parquet export, re-encoded)."""

    seq: int
    time: datetime
    subject: str
    data: bytes
    headers: dict[str, str] | None
    decoded: DecodedGroup | Exception | None = field(default=None, compare=False, repr=False)
    """`decode_group(data)` done ahead (or the error it raised); None: not decoded yet."""

    def with_decoded(self, decoded: DecodedGroup | Exception) -> Record:
        return Record(self.seq, self.time, self.subject, self.data, self.headers, decoded)


def range_subjects(run: str, kind: str) -> list[str]:
    s = Subjects(run)
    return {"train": [s.trajectories], "eval": [s.trajectories_eval], "all": [s.trajectories, s.trajectories_eval]}[kind]


class StreamReader:
    """`async for record in StreamReader(js, run, rng)`: the range's messages, in order, once."""

    def __init__(self, js: JetStreamContext, run: str, rng: RangeSettings, *, start_after: int = 0,
                 batch: int = 64, fetch_timeout_s: float = 1.0, retry: RetryPolicy | None = None) -> None:
        """`retry`: the service's retry policy (`Bus.retry`; None: a fresh one)."""
        self.js = js
        self.retry = retry if retry is not None else RetryPolicy()
        self.run = run
        self.rng = rng
        self.start_after = start_after
        """Resume point: read only sequences after it (a checkpoint's last consumed sequence)."""
        self.batch = batch
        self.fetch_timeout_s = fetch_timeout_s
        self.subjects = range_subjects(run, rng.kind)
        self.last_seq = 0
        self.end_seq: float = math.inf
        self.resets = 0
        self._consumer: str | None = None
        self._puller: Puller | None = None
        self._consumer_seq = 0

    @property
    def consumer(self) -> str | None:
        """The server's name of the consumer reading now (a new one after each reset)."""
        return self._consumer

    def _config(self, after: int) -> ConsumerConfig:
        cfg = ConsumerConfig(ack_policy=AckPolicy.NONE, filter_subjects=self.subjects, inactive_threshold=_INACTIVE_S,
                             mem_storage=True, num_replicas=1, max_deliver=1)
        start = max(self.rng.from_seq, after + 1)
        if after or self.rng.from_seq:
            cfg.deliver_policy, cfg.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, start
        elif self.rng.since is not None:
            cfg.deliver_policy, cfg.opt_start_time = DeliverPolicy.BY_START_TIME, self.rng.since
        else:
            cfg.deliver_policy = DeliverPolicy.ALL
        return cfg

    async def _open(self, after: int) -> None:
        """A new consumer starting after `after`, with the first batch asked for. A bus that does not
        answer yet (a cluster still electing) is waited out; the consumer is named before it is
        created, so that a retry after a lost reply finds it instead of making a second one."""
        await self._close_consumer()
        config = self._config(after)
        config.name = f"replay-{secrets.token_hex(8)}"
        info = await add_consumer(self.js, TRAJECTORIES_STREAM, config, policy=self.retry)
        self._consumer = info.name
        self._consumer_seq = info.delivered.consumer_seq if info.delivered else 0
        self._puller = Puller(self.js._nc, TRAJECTORIES_STREAM, info.name)  # the context's own connection
        await self._puller.start()
        await self._request()

    async def _request(self) -> None:
        assert self._puller is not None
        await self._puller.request(self.batch, expires_s=self.fetch_timeout_s if self.rng.follow else None)

    async def _close_consumer(self) -> None:
        puller, consumer, self._puller, self._consumer = self._puller, self._consumer, None, None
        if puller is not None:
            try:
                await puller.stop()
            except nats.errors.Error:
                pass
        if consumer is not None:
            try:
                await self.js.delete_consumer(TRAJECTORIES_STREAM, consumer)
            except (TimeoutError, nats.js.errors.NotFoundError, nats.errors.Error):
                pass  # ephemeral: the server deletes it after `inactive_threshold` anyway

    async def _snapshot_end(self) -> float:
        """The range's last sequence: to_seq, and without follow the range's newest message now, as the
        stream's leader has it (0: the range is empty). Not the consumer's count of pending messages:
        a consumer placed on a replica that is catching up counts what that replica has."""
        end = float(self.rng.to_seq) if self.rng.to_seq else math.inf
        if self.rng.follow:
            return end
        newest = await self._newest()
        if newest is None or newest.seq is None:
            return 0.0
        if self.rng.since is not None and newest.time is not None and newest.time < self.rng.since:
            return 0.0  # it starts after the newest message
        return min(end, float(newest.seq))

    async def _newest(self) -> RawStreamMsg | None:
        """The newest message on the range's subjects (None: none). The leader answers; a bus that does
        not answer yet, or a stream electing its leader, is waited out (`js_api_call`)."""
        newest: RawStreamMsg | None = None
        for subject in self.subjects:
            last = functools.partial(self.js.get_last_msg, TRAJECTORIES_STREAM, subject)
            try:
                msg = await js_api_call(f"stream {TRAJECTORIES_STREAM}: last message on {subject}", last, policy=self.retry)
            except nats.js.errors.NotFoundError:
                continue
            if newest is None or (msg.seq or 0) > (newest.seq or 0):
                newest = msg
        return newest

    def _read_all(self) -> bool:
        """Without follow: the range's last message is read (or the range starts after it)."""
        return not self.rng.follow and max(self.last_seq, self.rng.from_seq - 1) >= self.end_seq

    async def __aiter__(self) -> AsyncIterator[Record]:
        async with contextlib.aclosing(self.batches()) as batches:
            async for records in batches:
                for record in records:
                    yield record

    async def batches(self) -> AsyncGenerator[list[Record], None]:
        """The range in order, as the (never empty) lists of records that each pull brought."""
        self.end_seq = await self._snapshot_end()
        self.last_seq = self.start_after
        if self._read_all():
            return  # an empty range: no consumer needed
        await self._open(self.start_after)
        try:
            while True:
                if self._read_all():
                    return
                assert self._puller is not None and self._consumer is not None
                try:
                    msgs = await self._puller.take(self.batch, self.fetch_timeout_s)
                except TimeoutError:
                    try:  # nothing came: a pull for a consumer the server has dropped gets no answer
                        info = await self.js.consumer_info(TRAJECTORIES_STREAM, self._consumer)
                    except (nats.js.errors.NotFoundError, nats.js.errors.ServiceUnavailableError) as exc:
                        await self._reset(f"consumer lost: {exc!r}")
                        continue
                    if not self.rng.follow and not info.num_pending:
                        # the consumer has nothing more, and the range is not read: its replica is
                        # catching up, or the rest was deleted since the start (then the end moves back)
                        self.end_seq = min(self.end_seq, await self._snapshot_end())
                        if self._read_all():
                            continue
                    await self._request()
                    continue
                except ConsumerLost as exc:
                    await self._reset(f"consumer lost: {exc}")
                    continue
                if self.rng.follow or msgs[-1].metadata.sequence.stream < self.end_seq:
                    # Ask for the next batch now, and let nats-py's flusher send the request: the
                    # server sends the batch while the caller decodes this one.
                    await self._request()
                    await asyncio.sleep(0)
                records: list[Record] = []
                end = False
                for msg in msgs:
                    meta = msg.metadata
                    if meta.sequence.consumer != self._consumer_seq + 1:
                        await self._reset(f"consumer sequence gap {self._consumer_seq} -> {meta.sequence.consumer}")
                        break
                    self._consumer_seq = meta.sequence.consumer
                    seq = meta.sequence.stream
                    if seq > self.end_seq or (self.rng.until is not None and meta.timestamp > self.rng.until):
                        end = True
                        break
                    self.last_seq = seq
                    records.append(Record(seq, meta.timestamp, msg.subject, msg.data, msg.headers))
                    if seq >= self.end_seq:
                        end = True
                        break
                if records:
                    yield records
                if end:
                    return
        finally:
            await self._close_consumer()

    async def _reset(self, why: str) -> None:
        self.resets += 1
        log.warning("reader consumer recreated", reason=why, after_seq=self.last_seq)
        await self._open(self.last_seq)
