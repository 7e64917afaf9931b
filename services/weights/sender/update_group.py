"""The weight-update group of a `WeightBroadcaster`: which servers are in it, and building, rebuilding and
destroying it with SGLang's `/init_weights_update_group` / `/destroy_weights_update_group` while this
process joins as rank 0. A server that answers and refuses to join is left out (`shunned`) for a few
versions; one that cannot be reached is asked again at the next version."""

from __future__ import annotations

import asyncio
import datetime
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch.distributed as dist

from services.common.logging import get_logger
from services.common.stores import listening_store

log = get_logger("weights.broadcast")

ATTEMPTS = 2
"""Builds of one group: the first, and one more without the members that could not join."""
JOIN_FAILED = "joining group"
"""How the server's answer starts when the rendezvous itself failed (not a refusal)."""
SHUN_VERSIONS = 10
"""A server that refused to join is left out of this many versions before it is asked again."""
BROKEN_GRACE_S = 2.0
"""After a failed rendezvous or broadcast, how long the members' answers are still awaited."""


class UpdateGroup:
    def __init__(self, servers: list[str], *, master_address: str, group_name: str, timeout_s: float,
                 http: httpx.AsyncClient, sender: ThreadPoolExecutor) -> None:
        self.servers = servers
        self.master_address = master_address
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.http = http
        self.sender = sender
        """The one thread the group's collectives run in (they block, and must stay in order)."""
        self.members: list[str] = []
        self.shunned: dict[str, tuple[int, str]] = {}
        """Servers that refused to join (answered, not unreachable): left out until the version given,
        with why. Building a group waits for every rank up to the deadline, so a server that keeps
        refusing must not cost every version that wait."""
        self.port = 0
        self.pg: Any = None
        self._store: Any = None

    @property
    def address(self) -> str:
        return f"{self.master_address}:{self.port}" if self.pg is not None else ""

    async def live(self, version: int, assumed: set[str] | frozenset[str] = frozenset()) -> tuple[list[str], dict[str, str]]:
        """The servers to send to, and those left out with why; `assumed` are taken as live unasked."""
        async def healthy(server: str) -> str | None:
            try:
                resp = await self.http.get(f"{server}/health", timeout=5.0)
            except httpx.HTTPError as exc:
                return f"unreachable: {exc!r}"
            return None if resp.status_code == 200 else f"not healthy: HTTP {resp.status_code}"

        shunned = {s: f"left out until version {until}: {why}" for s, (until, why) in self.shunned.items() if version < until}
        candidates = [s for s in self.servers if s not in shunned]
        answers = await asyncio.gather(*(healthy(s) if s not in assumed else _alive() for s in candidates))
        down = {s: a for s, a in zip(candidates, answers, strict=True) if a is not None} | shunned
        return [s for s in candidates if s not in down], down

    async def rebuild(self, live: list[str], failed: dict[str, str], version: int) -> list[str]:
        """A new group of this rank and `live`; members that cannot join are left out (and the group
        is built once more without them). Returns the members."""
        for _ in range(ATTEMPTS):
            await self.destroy()
            # SGLang's tensor-parallel ranks each join the group: a server of tp_size k takes ranks
            # rank_offset .. rank_offset + k - 1 (the CPU server has one).
            tp = await asyncio.gather(*(self._tp_size(s) for s in live))
            offsets = [1 + sum(tp[:i]) for i in range(len(live))]
            world = 1 + sum(tp)
            store = await asyncio.to_thread(self._open_store, world)
            body = {"master_address": self.master_address, "master_port": store.port, "world_size": world,
                    "group_name": self.group_name, "backend": "gloo"}
            calls = [asyncio.ensure_future(self.post(s, "/init_weights_update_group", {**body, "rank_offset": off}))
                     for s, off in zip(live, offsets, strict=True)]
            joined = asyncio.get_running_loop().run_in_executor(self.sender, self._join, store, world)
            error = await outcome(joined)
            # Members still waiting in a rendezvous that failed here would answer only at their own
            # deadline: wait a moment for the answers (a refusal comes at once), then stop waiting.
            done, pending = await asyncio.wait(calls, timeout=None if error is None else BROKEN_GRACE_S)
            for c in pending:
                c.cancel()
            answers = [c.result() if c in done else f"{JOIN_FAILED}: no answer after the rendezvous failed" for c in calls]
            bad = {s: f"could not join the weight-update group: {a}" for s, a in zip(live, answers, strict=True) if a}
            if error is None and not bad:
                self._store, self.pg, self.members, self.port = store, joined.result(), live, store.port
                log.info("weight-update group built", members=live, address=self.address)
                return live
            # A member that refused up front makes every other member's rendezvous time out too:
            # leave out only the ones that refused, if any did, and build again.
            refused = {s: why for s, why in bad.items() if "HTTP 4" in why and JOIN_FAILED not in why}
            left_out = refused or bad
            failed.update(left_out)
            for server, why in refused.items():  # it answered and refused: it will refuse again for a while
                self.shunned[server] = (version + SHUN_VERSIONS, why)
            live = [s for s in live if s not in left_out]
            log.warning("building the weight-update group failed", error=repr(error), left_out=list(left_out))
            if not live:
                break
        self.members = []
        return []

    async def _tp_size(self, server: str) -> int:
        """The server's tensor-parallel size from `/get_server_info` (1 if it does not say)."""
        try:
            body = (await self.http.get(f"{server}/get_server_info", timeout=5.0)).json()
            return max(1, int(body.get("tp_size") or 1)) if isinstance(body, dict) else 1
        except (httpx.HTTPError, ValueError, TypeError):
            return 1

    def _open_store(self, world: int) -> Any:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        return listening_store(self.master_address, 0, world, timeout)  # on master_address only, not every interface

    def _join(self, store: Any, world: int) -> Any:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        return dist.ProcessGroupGloo(dist.PrefixStore(self.group_name, store), 0, world, timeout)

    async def destroy(self) -> None:
        if self.pg is None:
            return
        members, self.members = self.members, []
        await asyncio.gather(*(self.post(s, "/destroy_weights_update_group", {"group_name": self.group_name}, quick=True)
                               for s in members))
        self.pg = self._store = None

    async def post(self, server: str, path: str, body: dict[str, Any], *, quick: bool = False) -> str | None:
        """None on success, else why not."""
        try:
            resp = await self.http.post(f"{server}{path}", json=body,
                                         timeout=5.0 if quick else httpx.USE_CLIENT_DEFAULT)
        except httpx.HTTPError as exc:
            return f"{path}: {short_error(exc)}"
        try:
            answer = resp.json()
        except ValueError:
            answer = {"message": resp.text[:300]}
        if resp.status_code == 200 and (not isinstance(answer, dict) or answer.get("success", True)):
            return None
        message = answer.get("message", answer) if isinstance(answer, dict) else answer
        return f"{path}: HTTP {resp.status_code}: {message}"



def short_error(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + "..."


async def _alive() -> None:
    return None


async def outcome(fut: Any) -> BaseException | None:
    """The exception a future ended with, None if it succeeded."""
    try:
        await fut
    except Exception as exc:  # the group's failure, reported with the members' answers
        return exc
    return None
