"""A nats-server killed in the middle of an object-store upload (the trainer's publish) and of a
download (the agent's fetch), and restarted on the same port and store after longer than the
per-attempt chunk timeout: both complete, bit-exact, leaving no chunks of the failed attempts behind."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from schemas.subjects import WEIGHTS_BUCKET
from services.bus.nats_server import NatsServer, free_port
from services.common.bus import connect
from services.common.busretry import RetryPolicy
from services.weights import objstore
from services.weights.agent import objread
from services.weights.sender.publisher import WeightPublisher

CHUNK = 256 * 1024
CHUNK_TIMEOUT_S = 2.0
"""Per attempt; the outages below last longer."""
BIG = 48 * 1024 * 1024 + 5
"""193 chunks: the upload is killed after a few; the download when its first batch (64) is written,
while the second is on its way, so the third is asked for with the server down."""


@pytest.fixture
def server(tmp_path: Path) -> NatsServer:
    srv = NatsServer(tmp_path / "nats", port=free_port()).start()  # a fixed port: restarted on it
    yield srv
    srv.stop()


@pytest.fixture
async def nc(server: NatsServer) -> AsyncIterator[NATS]:
    conn = await connect(server.url, "weights-under-test")  # reconnects forever, as the services' do
    yield conn
    with contextlib.suppress(Exception):  # nats-py's close can raise while it reconnects
        await conn.close()


def kill(server: NatsServer) -> None:
    assert server.proc is not None
    server.proc.kill()  # SIGKILL: no goodbye to the clients
    server.proc.wait()


class Retries:
    """Errors the code under test retried, and a wait for a kind of them."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self._changed = asyncio.Event()

    def __call__(self, exc: BaseException) -> None:
        self.errors.append(exc)
        self._changed.set()

    async def wait_for(self, kind: type[BaseException], task: asyncio.Task) -> None:
        """Until an error of `kind` was retried; `task` (the call under test) must not end meanwhile."""
        while not any(isinstance(e, kind) for e in self.errors):
            self._changed.clear()
            changed = asyncio.ensure_future(self._changed.wait())
            await asyncio.wait({changed, task}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            assert not task.done(), f"ended while the server was down: {task.exception() or task.result()!r}"


def checkpoint(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(os.urandom(BIG))
    return root


async def test_upload_rides_out_a_server_kill_longer_than_the_chunk_timeout(server: NatsServer, nc: NATS, tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path / "ckpt")
    retries = Retries()
    pub = WeightPublisher(nc, "wout", chunk_size=CHUNK, chunk_timeout_s=CHUNK_TIMEOUT_S, bus_retry_timeout_s=120, on_retry=retries)
    await pub.latest()  # stream and bucket declared before the kill

    # A second connection watches the chunks arrive and kills the server after the 8th: the upload is
    # then at most a window of publishes further, far from its 193.
    watcher = await connect(server.url, "watcher")
    seen = 0

    async def on_chunk(_msg: object) -> None:
        nonlocal seen
        seen += 1
        if seen == 8:
            kill(server)  # synchronous: the upload cannot run meanwhile

    await watcher.subscribe(f"$O.{WEIGHTS_BUCKET}.C.>", cb=on_chunk)
    publishing = asyncio.create_task(pub.publish_dir(1, 1, ckpt))
    try:
        # down until a chunk's ack has been waited for in vain (the error that used to end the upload)
        await retries.wait_for(objstore.ChunkTimeout, publishing)
        await asyncio.to_thread(server.start)
        msg = await asyncio.wait_for(publishing, 120)
    finally:
        publishing.cancel()
        with contextlib.suppress(Exception):
            await watcher.close()

    big = next(f for f in msg.files if f.name == "model.safetensors")
    assert (big.size, big.sha256) == (BIG, hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest())
    out = io.BytesIO()
    info, digest = await objread.get_file(nc.jetstream(), WEIGHTS_BUCKET, "wout/v1/model.safetensors", out, policy=RetryPolicy())
    assert out.getvalue() == (ckpt / "model.safetensors").read_bytes() and digest == big.sha256
    # the chunks of the killed attempt were purged once the server was back: one chunk subject per object
    state = await nc.jetstream().stream_info(f"OBJ_{WEIGHTS_BUCKET}", subjects_filter=f"$O.{WEIGHTS_BUCKET}.C.>")
    assert len(state.state.subjects or {}) == 2 and info.chunks == 193


class KillOnFirstWrite(io.BytesIO):
    """A download destination that kills the server when the first batch of chunks is written."""

    def __init__(self, server: NatsServer) -> None:
        super().__init__()
        self.server = server

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if not self.tell():
            kill(self.server)
        return super().write(data)


async def test_download_resumes_after_a_server_kill_longer_than_the_chunk_timeout(server: NatsServer, nc: NATS, tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path / "ckpt")
    msg = await WeightPublisher(nc, "wout", chunk_size=CHUNK).publish_dir(1, 1, ckpt)
    big = next(f for f in msg.files if f.name == "model.safetensors")

    js = nc.jetstream()
    before = (await js.stream_info(f"OBJ_{WEIGHTS_BUCKET}")).state.consumer_count  # the publisher's listing may linger
    retries = Retries()
    out = KillOnFirstWrite(server)
    reading = asyncio.create_task(objread.get_file(js, WEIGHTS_BUCKET, "wout/v1/model.safetensors", out,
                                                    timeout_s=CHUNK_TIMEOUT_S, retry_s=120, on_retry=retries,
                                                    policy=RetryPolicy()))
    try:
        await retries.wait_for(TimeoutError, reading)  # a batch waited for in vain, with the server down
        await asyncio.to_thread(server.start)
        _, digest = await asyncio.wait_for(reading, 120)
    finally:
        reading.cancel()
    assert out.getvalue() == (ckpt / "model.safetensors").read_bytes()
    assert digest == big.sha256
    # the reader held one consumer per attempt and deleted the last one when done
    assert (await js.stream_info(f"OBJ_{WEIGHTS_BUCKET}")).state.consumer_count <= before
