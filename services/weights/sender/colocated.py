"""`ColocatedSender`: the trainer hands each weight version to inference servers on its own host by
handle, with SGLang's `/update_weights_from_tensor`.

Per version: the gathered buckets are copied, as they come, into a `BufferSet` (shared memory on the
CPU, device memory on a GPU: `shm_pool.py`), the one copy of the transport; then one request per
server carries the handles to every tensor (`serialized_named_tensors`, `tensor_payload.py`) with
`weight_version`, so a server takes the whole version at once. The bytes never cross HTTP or a
socket. jetrl's CPU server with `adopt` (jetrl's extra field) serves straight from the buffers: the
swap is a pointer per tensor and the set stays the server's until it reports a newer version; SGLang
copies them into its own weights (it ignores `adopt`).

Every server is sent every version: one that is down answers at once (connection refused) and is
reported `unreachable`; one killed mid-update drops the connection; one that stalls is given up on
after `timeout_s`. None of them holds the trainer beyond that: each is reported failed, and the
others keep the version.
"""

from __future__ import annotations

import asyncio
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import torch

from schemas.tensor_payload import serialize
from services.common.logging import get_logger
from services.common.trust import InferenceAuth
from services.weights.sender.bucket_stream import BucketSource
from services.weights.sender.results import VersionResult, send_gathered
from services.weights.sender.shm_pool import COPY_THREADS, BufferPool, BufferSet, warm_shared_memory

log = get_logger("weights.colocated")

Outcome = tuple[Literal["loaded", "refused", "gone", "unsure"], str]
"""A server's answer to one version, and why (empty when loaded)."""


class ColocatedSender:
    transport: Literal["broadcast", "colocated"] = "colocated"

    def __init__(self, servers: list[str], *, dtype: str = "float32", bucket_mb: float = 64.0, timeout_s: float = 30.0,
                 adopt: bool = True, keys: tuple[str, str] = ("", "")) -> None:
        if not servers:
            raise ValueError("colocated: no servers given")
        self.servers = [s.rstrip("/") for s in servers]
        self.dtype: torch.dtype = getattr(torch, dtype)
        self.dtype_name = dtype
        self.bucket_bytes = max(1, int(bucket_mb * 1e6))
        self.timeout_s = timeout_s
        self.adopt = adopt
        self.pool = BufferPool()
        self._members: list[str] = []
        self._tp: dict[str, int] = {}
        """Each server's tensor-parallel ranks (one payload entry each), read once from /get_server_info."""
        self._sessions: dict[str, bool] = {}
        """Whether a server wants SGLang's /begin_weight_update and /end_weight_update around an update
        (SGLang 0.5.23 does; jetrl's CPU server and older SGLang do not)."""
        self._copier = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="weights-copy")
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), auth=InferenceAuth(*keys))

    @property
    def address(self) -> str:
        return f"shm://{socket.gethostname()}"

    @property
    def members(self) -> list[str]:
        return list(self._members)

    async def build_ahead(self, wait_s: float) -> list[str]:
        """Nothing to build (the first version's request is the first contact), but torch's shared-memory
        manager is started now, during the engine's build: the first shared-memory buffer waits ~0.16 s
        for it (measured on the 2-core VM), which the first step would otherwise pay."""
        await asyncio.to_thread(warm_shared_memory)
        return []

    async def aclose(self) -> None:
        await self._http.aclose()
        self._copier.shutdown(wait=False, cancel_futures=True)

    async def send_version(self, version: int, state: dict[str, torch.Tensor]) -> VersionResult:
        return await send_gathered(self, version, state, self.dtype)

    async def send(self, version: int, source: BucketSource) -> VersionResult:
        t0 = time.perf_counter()
        result = VersionResult(version)
        bset = self.pool.acquire()
        try:
            named = await self._copy_in(bset, source, result)
            t1 = time.perf_counter()
            payload = await asyncio.to_thread(serialize, named)
            t2 = time.perf_counter()
            outcomes = await asyncio.gather(*(self._load(s, payload, str(version)) for s in self.servers))
            # from the first bucket there (a streamed version's source opens with the training call)
            ready = max(t0, source.ready_at or t0)
            result.stages.update(copy_s=t1 - ready, serialize_s=t2 - t1, load_s=time.perf_counter() - t2)
        finally:
            source.finish()
            self.pool.release(bset)
        refused: dict[str, str] = {}
        for server, (kind, why) in zip(self.servers, outcomes, strict=True):
            if kind == "loaded":
                self.pool.loaded(server, bset, self.adopt and bset.buffers[0].device.type == "cpu")
                continue
            if kind == "gone":
                self.pool.gone(server)
            elif kind == "unsure":
                self.pool.unsure(server, bset)
            refused[server] = why
            log.warning("colocated weights update failed", server=server, version=version, reason=why)
        result.settle(self.servers, refused)
        self._members = result.loaded
        return result.timed(t0, source)

    async def _copy_in(self, bset: BufferSet, source: BucketSource, result: VersionResult) -> list[tuple[str, torch.Tensor]]:
        """Every bucket copied into `bset` as the source gives it (and given back at once)."""
        named: list[tuple[str, torch.Tensor]] = []
        loop = asyncio.get_running_loop()
        while (bucket := await source.next()) is not None:
            try:
                views = await loop.run_in_executor(None, bset.place, result.buckets, bucket.tensors, self.dtype, self._copier)
            finally:
                source.release(bucket)
            named += zip(bucket.names, views, strict=True)
            result.buckets += 1
            result.bytes += bucket.nbytes
            if result.buckets == source.count:
                source.finish()  # all copied: the gather (the training call) may end now
                break
        return named

    async def _load(self, server: str, payload: str, version: str) -> Outcome:
        try:
            tp = await self._tp_size(server)
            body: dict[str, Any] = {
                "serialized_named_tensors": [payload] * tp, "load_format": None, "flush_cache": False,
                "weight_version": version, "adopt": self.adopt,
            }
            session = self._sessions.get(server, True)
            if session:
                session = self._sessions[server] = await self._begin(server)
            try:
                r = await self._http.post(f"{server}/update_weights_from_tensor", json=body,
                                          timeout=httpx.Timeout(self.timeout_s, connect=5.0))
            finally:
                if session:
                    await self._http.post(f"{server}/end_weight_update", json={})
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            return "gone", f"unreachable: {exc!r}"[:300]
        except httpx.TimeoutException:
            return "unsure", f"no answer within timeout_s={self.timeout_s}s"
        except httpx.TransportError as exc:  # the connection dropped: the server died mid-update
            return "gone", f"connection lost during the update: {exc!r}"[:300]
        except httpx.HTTPStatusError as exc:
            return "refused", str(exc)[:300]
        try:
            ok = r.status_code == 200 and bool(r.json().get("success", False))
        except ValueError:
            ok = False
        return ("loaded", "") if ok else ("refused", f"{r.status_code}: {r.text[:300]}")

    async def _begin(self, server: str) -> bool:
        """SGLang's /begin_weight_update; False where the server has no such route (no session needed)."""
        r = await self._http.post(f"{server}/begin_weight_update", json={})
        if r.status_code in (404, 405):
            return False
        if r.status_code != 200:
            raise httpx.HTTPStatusError(f"/begin_weight_update: {r.status_code} {r.text[:200]}", request=r.request, response=r)
        return True

    async def _tp_size(self, server: str) -> int:
        if server not in self._tp:
            r = await self._http.get(f"{server}/get_server_info")
            info = r.json() if r.status_code == 200 else {}
            self._tp[server] = int(info.get("tp_size", 1) or 1)
            if info.get("frontend") == "jetrl-cpu":
                self._sessions[server] = False  # takes an update without a session: two requests fewer
        return self._tp[server]
