"""The caller's side: `await RewardClient(nc).score(fn, items)` -> one `RewardResult` per item.

Errors say who is at fault: `RewardUnavailableError` when no reward service answered (none running,
or all too busy to answer in time: worth retrying later), `RewardRequestError` when a service
refused the request (function not on its allow-list, too many items: retrying will not help).
"""

from __future__ import annotations

import nats.errors
from nats.aio.client import Client as NATS

from schemas.messages import MessageError, RewardItem, RewardReply, RewardRequest, RewardResult, decode, encode
from schemas.subjects import REWARD_SUBJECT


class RewardUnavailableError(RuntimeError):
    """No reward service answered: no responders, or no reply within the timeout."""


class RewardRequestError(RuntimeError):
    """The reward service refused the request (`reply.error`) or answered something unusable."""


class RewardClient:
    def __init__(self, nc: NATS, timeout_s: float = 30.0) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        """Default wait for a whole request's reply."""

    async def score(
        self,
        fn: str,
        items: list[RewardItem],
        timeout_s: float | None = None,
        *,
        item_timeout_s: float | None = None,
    ) -> list[RewardResult]:
        """Score `items` with the reward function `fn` ("module:function"). `timeout_s` bounds the
        whole request (default: the client's); `item_timeout_s` asks the service for a per-item limit
        (default: the service's)."""
        if not items:
            return []
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        payload = encode(RewardRequest(fn=fn, items=list(items), timeout_s=item_timeout_s))
        try:
            msg = await self.nc.request(REWARD_SUBJECT, payload, timeout=wait_s)
        except nats.errors.NoRespondersError as exc:
            raise RewardUnavailableError(
                f"no reward service is listening on {REWARD_SUBJECT} (start one with `jetrl reward`)"
            ) from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise RewardUnavailableError(
                f"no reward service answered on {REWARD_SUBJECT} within {wait_s:g} s "
                f"({len(items)} items of {fn}); raise timeout_s or add reward replicas"
            ) from exc
        except nats.errors.MaxPayloadError as exc:
            raise RewardRequestError(f"reward request of {len(items)} items is larger than the NATS max_payload: {exc}") from exc
        try:
            reply = decode(RewardReply, msg.data)
        except MessageError as exc:
            raise RewardRequestError(f"the reward service sent a reply this client cannot read: {exc}") from exc
        if reply.error:
            raise RewardRequestError(reply.error)
        if len(reply.results) != len(items):
            raise RewardRequestError(f"the reward service sent {len(reply.results)} results for {len(items)} items")
        return reply.results
