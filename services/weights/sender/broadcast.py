"""`WeightBroadcaster`: the trainer's sending rank pushes one weight version to every inference
server over a gloo group, speaking SGLang's distributed weight-update protocol to each server.

Per version: find the live servers (`/health`); if they are not the group's members, rebuild the group
(`/destroy_weights_update_group`, then `/init_weights_update_group` on every member while this process
joins as rank 0 on a fresh port). Then per bucket (parameters in the served dtype, about `bucket_mb`
each): `/update_weights_from_distributed` to every member (names, dtypes, shapes, `checksum`; the last
bucket carries `weight_version`) while this process broadcasts the bucket's tensors, one broadcast per
tensor in `names` order, as SGLang receives them. A member that dies mid-broadcast fails the broadcast
within the group's deadline (`timeout_s`); the group is then rebuilt from the members still alive and
the version is sent again, so the others still get it and the trainer never hangs.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import torch

from services.common.logging import get_logger
from services.common.trust import InferenceAuth
from services.weights.sender.bucket_stream import BucketSource, ListSource
from services.weights.sender.buckets import Bucket, ensure_checksum
from services.weights.sender.results import VersionResult, send_gathered
from services.weights.sender.update_group import BROKEN_GRACE_S, UpdateGroup, outcome, short_error

log = get_logger("weights.broadcast")

ATTEMPTS = 2
"""Sends of one version: the first, and one more on a group rebuilt without the members that failed."""
WINDOW = 4
"""Buckets sent whose answers are not yet in (the members check one while receiving the next)."""


class GroupBroken(RuntimeError):
    """A broadcast over the group failed (a member died or stalled past the deadline)."""


class WeightBroadcaster:
    transport: Literal["broadcast", "colocated"] = "broadcast"

    def __init__(self, servers: list[str], *, master_address: str = "127.0.0.1", dtype: str = "float32",
                 bucket_mb: float = 64.0, timeout_s: float = 30.0, group_name: str = "jetrl-weights",
                 checksum: bool = True, keys: tuple[str, str] = ("", "")) -> None:
        if not servers:
            raise ValueError("broadcast: no servers given")
        self.servers = [s.rstrip("/") for s in servers]
        self.master_address = master_address
        self.dtype: torch.dtype = getattr(torch, dtype)
        self.dtype_name = dtype
        self.bucket_bytes = max(1, int(bucket_mb * 1e6))
        self.timeout_s = timeout_s
        self.group_name = group_name
        self.checksum = checksum
        self._send_s = 0.0
        self._membership = asyncio.Lock()
        """Held by a send and by `build_ahead`'s rebuild: the group changes under one of them at a time."""
        self._sent = False
        # the group's collectives block a thread; one thread keeps them in order
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-send")
        # a call may wait for a whole bucket's broadcast, which the group bounds by timeout_s
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s * 2 + 30, connect=5.0),
                                       auth=InferenceAuth(*keys))  # the servers' (api_key, admin_api_key)
        self.group = UpdateGroup(self.servers, master_address=master_address, group_name=group_name,
                                 timeout_s=timeout_s, http=self._http, sender=self._sender)

    @property
    def members(self) -> list[str]:
        return self.group.members

    async def aclose(self) -> None:
        await self.group.destroy()
        await self._http.aclose()
        self._sender.shutdown(wait=False, cancel_futures=True)

    @property
    def address(self) -> str:
        return self.group.address

    # ------------------------------------------------------------------------------ one version

    async def send_version(self, version: int, state: dict[str, torch.Tensor]) -> VersionResult:
        """Send a version gathered in full (`state`)."""
        return await send_gathered(self, version, state, self.dtype)

    async def build_ahead(self, wait_s: float, poll_s: float = 0.5) -> list[str]:
        """Build the group before the first version, so that the first version does not wait for the
        rendezvous: waits up to `wait_s` for every server's /health, then builds with those that answer
        (one that comes later joins at a later version, as any late server does). Does nothing once a
        version is being sent. Returns the members."""
        deadline = time.monotonic() + wait_s
        while True:
            if self._sent:
                return self.members
            live, down = await self.group.live(0)
            if not down or time.monotonic() >= deadline:
                break
            await asyncio.sleep(poll_s)
        if not live:
            log.warning("no server to build the weight-update group with before the first version",
                        waited_s=wait_s, down=down)
            return []
        async with self._membership:
            if self._sent or self.group.pg is not None:
                return self.members
            return await self.group.rebuild(live, {}, 0)

    async def send(self, version: int, source: BucketSource) -> VersionResult:
        """Send a version's buckets as `source` gives them (`BucketStream`: as the trainer gathers them).
        A failed broadcast restarts the source on the rebuilt group; the source is finished on return."""
        self._sent = True
        async with self._membership:  # a group `build_ahead` is building is waited for, then used
            return await self._send(version, source)

    async def _send(self, version: int, source: BucketSource) -> VersionResult:
        t0 = time.perf_counter()
        result = VersionResult(version)
        self._send_s = 0.0
        try:
            for attempt in range(ATTEMPTS):
                if attempt:
                    source.restart()  # gathered again meanwhile, from the first bucket
                # The members of an intact group are not asked for /health: a member that died fails the
                # broadcast itself (and the retry asks everyone). That saves a request per version through
                # each server's busy event loop; only servers outside the group are polled, to let them in.
                assumed = set(self.members) if self.group.pg is not None and attempt == 0 else set()
                live, down = await self.group.live(version, assumed)
                result.failed = dict(down)
                if not live:
                    break
                if live != self.members or self.group.pg is None:
                    live = await self.group.rebuild(live, result.failed, version)
                    result.rebuilds += 1
                    if not live:
                        break
                refused: dict[str, str] = {}
                try:
                    refused = await self._send_buckets(source, version, result)
                except GroupBroken as exc:
                    # Who is gone is decided by /health on the next attempt: a member that merely did not
                    # answer in time (its receive was cut short by the failure) gets the version again.
                    log.warning("broadcast failed; rebuilding the group from the members still alive",
                                version=version, attempt=attempt + 1, error=str(exc))
                    result.failed.update({s: f"broadcast failed: {exc}" for s in self.members})
                    await self.group.destroy()
                    continue
                except BaseException:
                    # the source ended early (the gather failed): members hold part of a version; a new
                    # group makes them drop it
                    await self.group.destroy()
                    raise
                result.settle(self.members, refused)
                if refused:
                    # A member that refused a bucket may not have taken its bytes off the wire (a request
                    # it could not parse): the group may be out of step, so the next version builds anew.
                    await self.group.destroy()
                break
        finally:
            source.finish()
        # from the first bucket there to send: a streamed version's source opens with the training call
        # that gathers it, and the wait for that call's gather is training time, not broadcast time
        result.stages.update(send_s=self._send_s)
        return result.timed(t0, source)

    async def _send_buckets(self, source: BucketSource | list[Bucket], version: int,
                            result: VersionResult | None = None) -> dict[str, str]:
        """Every bucket in order, the last with `weight_version`. Pipelined: bucket n+1 is taken (gathered,
        when streamed) and its checksum computed while bucket n is on the wire, and bucket n+1 goes out
        while the members still check bucket n (up to WINDOW buckets unanswered); a bucket is given back
        to the source once broadcast. Returns the members that refused any (with why)."""
        if isinstance(source, list):
            source = ListSource(source)
        result = result if result is not None else VersionResult(version)
        refused: dict[str, str] = {}
        unanswered: deque[list[asyncio.Future[str | None]]] = deque()

        async def collect(calls: list[asyncio.Future[str | None]]) -> None:
            for server, why in zip(self.members, await asyncio.gather(*calls), strict=True):
                if why is not None:
                    refused.setdefault(server, why)

        async def take() -> Bucket | None:
            assert not isinstance(source, list)
            bucket = await source.next()
            if bucket is not None and self.checksum:
                try:
                    await ensure_checksum(bucket)
                except BaseException:  # cancelled (the broadcast failed): the bucket is not sent
                    source.release(bucket)
                    raise
            return bucket

        result.buckets = result.bytes = 0
        ahead: asyncio.Future[Bucket | None] = asyncio.ensure_future(take())
        fresh = True  # `ahead` holds a bucket the loop has not taken yet
        try:
            while (bucket := await ahead) is not None:
                fresh = False
                last = result.buckets == source.count - 1
                if not last:
                    ahead, fresh = asyncio.ensure_future(take()), True
                if len(unanswered) >= WINDOW:
                    await collect(unanswered.popleft())
                try:
                    unanswered.append(await self._put_bucket(bucket, str(version) if last else None))
                finally:
                    source.release(bucket)
                result.buckets += 1
                result.bytes += bucket.nbytes
                result.stages["checksum_s"] = result.stages.get("checksum_s", 0.0) + bucket.checksum_s
                if last:
                    source.finish()  # all on the wire: the gather (the training call) may end now
                    break
            while unanswered:
                await collect(unanswered.popleft())
        finally:
            if fresh and not ahead.done():
                ahead.cancel()
            elif fresh and not ahead.cancelled() and ahead.exception() is None and (taken := ahead.result()) is not None:
                source.release(taken)  # taken ahead, never sent
            for calls in unanswered:
                for c in calls:
                    c.cancel()
        return refused

    async def _send_bucket(self, bucket: Bucket, version: str | None) -> dict[str, str]:
        """One bucket, answers awaited: the members that refused it (with why)."""
        calls = await self._put_bucket(bucket, version)
        answers = await asyncio.gather(*calls)
        return {s: a for s, a in zip(self.members, answers, strict=True) if a is not None}

    async def _put_bucket(self, bucket: Bucket, version: str | None) -> list[asyncio.Future[str | None]]:
        """Announce one bucket to every member and broadcast it; returns the members' answers still
        to come. Raises GroupBroken when the broadcast itself failed."""
        body: dict[str, Any] = {
            "names": bucket.names, "dtypes": [self.dtype_name] * len(bucket.names),
            "shapes": [list(t.shape) for t in bucket.tensors], "group_name": self.group_name,
            "flush_cache": False,
        }
        if self.checksum:
            body["checksum"] = bucket.checksum
        if version is not None:
            body["weight_version"] = version
        calls: list[asyncio.Future[str | None]] = [
            asyncio.ensure_future(self.group.post(s, "/update_weights_from_distributed", body)) for s in self.members]
        sent = asyncio.get_running_loop().run_in_executor(self._sender, self._broadcast, bucket.tensors)
        send_error = await outcome(sent)
        if send_error is None:
            return calls
        # A member that still waits for the rest of the bucket would hold us up to its own deadline:
        # give the answers a moment, then stop waiting (the group is rebuilt anyway).
        done, pending = await asyncio.wait(calls, timeout=BROKEN_GRACE_S)
        for c in pending:
            c.cancel()
        answers = [c.result() if c in done else "no answer after the broadcast failed" for c in calls]
        raise GroupBroken(f"{short_error(send_error)}; members' answers: {dict(zip(self.members, answers, strict=True))}")

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        # Every broadcast is queued before any is waited for: gloo runs them in its own threads, in
        # the order queued (each carries its sequence tag), so this thread takes the GIL once per
        # bucket, not once per tensor; on a busy process each take can cost a switch interval (5 ms).
        works = [self.group.pg.broadcast(t, 0) for t in tensors]
        for w in works:
            w.wait()
        self._send_s += time.perf_counter() - t0
