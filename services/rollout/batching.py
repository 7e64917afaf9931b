"""Coalesce the `/generate` passes of one event-loop turn into one batched SGLang request.

A group's samples are started together (`asyncio.gather` of `agenerate` calls), so their first passes
reach the engine in the same turn of the event loop; so do the continuations after a pause aborted
them. `GenerateBatcher` holds each pass until the end of that turn, then sends those bound for the same
server as one `/generate` with a list of `input_ids` (SGLang's batch form; the server answers a list,
one output per input) and hands each caller its own output. One HTTP request, one JSON body and one
server-side request parse per group instead of per sample; the researcher's code still calls
`agenerate` once per sample and cannot tell.

Failures stay per sample: a batch the server refuses (HTTP 4xx: one bad input fails the whole batch in
SGLang) is sent again one pass per request, so each caller gets its own answer or its own error.
Transport failures (retries, failover to the next server) apply to the batch as a whole, as they would
to each of its passes. A caller cancelled while its batch runs gets nothing; the batch is cancelled
once all its callers are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from schemas.sglang_protocol import ProtocolError, batch_key, build_batch_payload, split_batch_reply
from services.common.logging import get_logger
from services.rollout.io_struct import BadRequestError, InferenceError
from services.rollout.turn_batch import fail, send_batch

log = get_logger("inference-client")

Post = Callable[[str, dict[str, Any], str | None, int], Awaitable[tuple[Any, str]]]
"""The engine's POST of `/generate` with retries and failover: (server, payload, episode, samples)
-> (reply body, the server that answered)."""


@dataclass
class _Pass:
    payload: dict[str, Any]
    episode: str | None
    future: asyncio.Future[tuple[Any, str]]


class GenerateBatcher:
    def __init__(self, post: Post, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"batch_max_size must be >= 1, got {max_size}")
        self._post = post
        self.max_size = max_size
        self._pending: dict[tuple[Any, ...], list[_Pass]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # strong references: a bare task may be collected
        self.batches = 0
        """Batched requests sent (more than one pass each)."""
        self.split = 0
        """Batches the server refused and that were sent again one pass per request."""

    async def generate(self, server: str, payload: dict[str, Any], episode: str | None) -> tuple[Any, str]:
        """One `/generate` pass, sent with whatever other passes for `server` arrive in this turn."""
        loop = asyncio.get_running_loop()
        key = (server, *batch_key(payload))
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = []
            loop.call_soon(self._flush, key)  # after every task already runnable in this turn
        item = _Pass(payload, episode, loop.create_future())
        pending.append(item)
        if len(pending) >= self.max_size:
            self._flush(key)
        return await item.future

    def _flush(self, key: tuple[Any, ...]) -> None:
        items = self._pending.pop(key, None)
        if not items:
            return
        send_batch(self._tasks, self._send(key[0], items), [i.future for i in items])

    async def _send(self, server: str, items: list[_Pass]) -> None:
        if len(items) == 1:
            await self._one(server, items[0])
            return
        self.batches += 1
        payload = build_batch_payload([i.payload for i in items])
        try:
            body, answered = await self._post(server, payload, None, len(items))
            outputs = split_batch_reply(body, len(items))
        except BadRequestError as exc:
            # SGLang refuses a whole batch for one bad input: find out which, one pass per request
            self.split += 1
            if self.split & (self.split - 1) == 0:  # 1st, 2nd, 4th, ...: a server refusing every batch does not flood the log
                log.warning("batched /generate refused; sending its passes one by one", server=server, size=len(items),
                            refused_batches=self.split, error=str(exc))
            await asyncio.gather(*(self._one(server, i) for i in items if not i.future.done()))
            return
        except ProtocolError as exc:
            _fail(items, InferenceError(f"{server}: {exc}"))
            return
        except asyncio.CancelledError:
            _cancel(items)
            raise
        except Exception as exc:  # every server unavailable: each pass of the batch gets the error
            _fail(items, exc)
            return
        for item, out in zip(items, outputs, strict=True):
            if not item.future.done():
                item.future.set_result((out, answered))

    async def _one(self, server: str, item: _Pass) -> None:
        try:
            result = await self._post(server, item.payload, item.episode, 1)
        except asyncio.CancelledError:
            _cancel([item])
            raise
        except Exception as exc:
            _fail([item], exc)
            return
        if not item.future.done():
            item.future.set_result(result)


def _fail(items: list[_Pass], exc: Exception) -> None:
    fail([i.future for i in items], exc)


def _cancel(items: list[_Pass]) -> None:
    for item in items:
        item.future.cancel()
