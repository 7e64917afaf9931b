"""Where a version's buckets come from when the sender (`WeightBroadcaster.send`) takes them.

- `ListSource`: every bucket already made (`make_buckets` over a gathered state).
- `BucketStream`: rank 0's hand-off from the trainer's bucket-by-bucket gather, which runs in the
  training call's thread on every rank (`services/trainer/model/gather.py`), to the sender on the event
  loop. The gather asks the stream which bucket to gather next (`next_index`) and hands it over
  (`put`); the sender takes it (`next`), sends it and gives it back (`release`). A bucket is gathered
  only while fewer than `held` are out (put, not yet released): the sender's bucket on the wire and
  the next one, whose checksum it computes meanwhile; so rank 0 holds at most `held` gathered buckets
  instead of the whole model. The stream counts the bytes held and their peak (`peak_bytes`).

The sender steers the gather: `restart` (a member died mid-version: the group is rebuilt and the
version sent again from bucket 0, gathered again on every rank) and `finish` (the last bucket went
out, or nothing more is to be sent): the gather stops once it asks for its next bucket. So the
training call ends once the last bucket is on the wire. A version of at most `held` buckets fits the
budget whole: it is kept until finished, the gather (and the call) ends as soon as it is all put, and
a restart sends it again from memory (the demo's model: one bucket, the send wholly in the background).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from services.weights.sender.buckets import Bucket

HELD = 2
"""Gathered buckets rank 0 holds at most: the one on the wire and the next (its checksum is computed
meanwhile). One more would not make the wire busier: gathering a bucket is faster than sending it."""


@dataclass
class StreamSpec:
    """How the training call gathers a version bucket by bucket into rank 0's stream (pickled with
    the train command to every rank)."""

    dtype: str
    """The served dtype (`weights.dtype`)."""
    bucket_bytes: int


class StreamClosed(RuntimeError):
    """The stream ended before the version was complete (the gather failed or was abandoned)."""


class BucketSource(Protocol):
    count: int
    """Buckets of the version (known once the first has come)."""
    peak_bytes: int
    """The most gathered bytes held at once."""
    ready_at: float | None
    """`time.perf_counter()` when the version's first bucket was there to send (None: not yet): the
    broadcast's time counts from here, not from the start of the training call that gathers it."""

    async def next(self) -> Bucket | None: ...
    def release(self, bucket: Bucket) -> None: ...
    def restart(self) -> None: ...
    def finish(self) -> None: ...


class ListSource:
    """A version already bucketed in memory."""

    def __init__(self, buckets: list[Bucket]) -> None:
        self.buckets = buckets
        self.count = len(buckets)
        self.peak_bytes = sum(b.nbytes for b in buckets)
        self.ready_at: float | None = time.perf_counter()
        self._i = 0

    async def next(self) -> Bucket | None:
        if self._i >= self.count:
            return None
        self._i += 1
        return self.buckets[self._i - 1]

    def release(self, bucket: Bucket) -> None:
        return None

    def restart(self) -> None:
        self._i = 0

    def finish(self) -> None:
        return None


class BucketStream:
    def __init__(self, loop: asyncio.AbstractEventLoop, held: int = HELD) -> None:
        self.loop = loop
        self.held_max = held
        self.count = 0
        self.nbytes = 0
        """Bytes of the whole version (from the gather's plan)."""
        self.held_bytes = 0
        self.peak_bytes = 0
        """The most gathered bytes rank 0 held at once (put, not yet released)."""
        self.gathered = 0
        """Buckets gathered, over every pass (a restart gathers the version again)."""
        self.dropped = 0
        """Buckets gathered but not sent: put after a restart or finish."""
        self.ready_at: float | None = None
        self._cond = threading.Condition()
        self._ready: deque[Bucket] = deque()
        self._held = 0
        self._next = 0
        """The bucket the gather does next."""
        self._taken = 0
        """Buckets of the current pass the sender took."""
        self._stale = False
        """The bucket being gathered belongs to a pass that was restarted or finished: drop it."""
        self._kept: list[Bucket] = []
        """A small version (at most `held` buckets): every bucket put in this pass, kept for a replay."""
        self._whole = False
        """A small version is all gathered and kept: the gather has ended, a restart replays `_kept`."""
        self._started = False
        self._finished = False
        self._closed = False
        self._error: BaseException | None = None
        self._wake = asyncio.Event()

    # ---- the gather's side (the training call's thread on rank 0) ------------------------------
    def start(self, count: int, nbytes: int) -> None:
        with self._cond:
            self.count, self.nbytes, self._started = count, nbytes, True
        self._signal()

    def next_index(self) -> int:
        """The bucket to gather next, once fewer than `held` are out; -1: stop gathering."""
        with self._cond:
            while not self._finished and (self._next >= self.count or self._held >= self.held_max):
                if self._small and len(self._kept) == self.count:
                    self._whole = True
                    return -1
                self._cond.wait()
            if self._finished:
                return -1
            self._stale = False
            self._next += 1
            return self._next - 1

    def put(self, bucket: Bucket) -> None:
        with self._cond:
            self.gathered += 1
            if self._stale or self._finished:
                self.dropped += 1
                return
            if self.ready_at is None:
                self.ready_at = time.perf_counter()
            self._held += 1
            self.held_bytes += bucket.nbytes
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            self._ready.append(bucket)
            if self._small:
                self._kept.append(bucket)
        self._signal()

    def close(self, error: BaseException | None = None) -> None:
        """The gather is over (`error`: it failed); the sender stops waiting for buckets."""
        with self._cond:
            self._closed, self._error = True, error
            if error is not None or not self._whole:
                self._finished = True
            self._cond.notify_all()
        self._signal()

    # ---- the sender's side (the event loop) -----------------------------------------------------
    async def next(self) -> Bucket | None:
        """The next bucket of the version, in order; None after the last. Raises StreamClosed if the
        gather ended first."""
        while True:
            with self._cond:
                if self._started and self._taken >= self.count:
                    return None
                if self._ready:
                    self._taken += 1
                    return self._ready.popleft()
                if self._finished or self._error is not None or (self._closed and not self._whole):
                    why = f"the weights gather failed: {self._error!r}" if self._error else "the weights gather ended early"
                    raise StreamClosed(why)
                self._wake.clear()
            await self._wake.wait()

    def release(self, bucket: Bucket) -> None:
        with self._cond:
            if self._small:  # kept until finished (counted as held)
                return
            self._held -= 1
            self.held_bytes -= bucket.nbytes
            self._cond.notify_all()

    def restart(self) -> None:
        """Send the version again from its first bucket: what is held is dropped, the gather starts over."""
        with self._cond:
            if self._finished:
                return
            self._taken = 0
            if self._whole:  # gathered whole and kept: sent again from memory
                self._ready = deque(self._kept)
                return
            self._drop_ready()
            if self._small:
                self._kept.clear()
                self._held = self.held_bytes = 0
            self._next = 0
            self._stale = True
            self._cond.notify_all()

    def finish(self) -> None:
        """Nothing more is sent: the gather stops at its next bucket."""
        with self._cond:
            self._finished = True
            self._stale = True
            self._drop_ready()
            self._kept.clear()
            self._cond.notify_all()
        self._signal()

    @property
    def _small(self) -> bool:
        return self._started and self.count <= self.held_max

    def _drop_ready(self) -> None:
        while self._ready:
            b = self._ready.popleft()
            self._held -= 1
            self.held_bytes -= b.nbytes
            self.dropped += 1

    def _signal(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass
