"""The sender's side of the streamed gather, against two real CPU inference servers: a producer thread
in place of the trainer's gather (`services/trainer/model/gather.py` drives a `BucketStream` the same way:
`start`, `next_index`/`put` until -1, `close`). A server SIGKILLed in the middle of a streamed version
restarts the stream (the version is gathered again from bucket 0) and the survivor gets it whole; a
gather that fails mid-version leaves every server on its old weights, and the next version lands; a
version of at most two buckets is gathered without waiting for the sender."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from services.weights.sender.broadcast import WeightBroadcaster
from services.weights.sender.bucket_stream import BucketStream, StreamClosed
from services.weights.sender.buckets import Bucket, make_buckets
from tests.support.inference import running_servers


def model_state(model_dir: Path, shift: float) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return {n: p.detach() + shift for n, p in model.named_parameters()}


def served(url: str, name: str) -> torch.Tensor:
    body = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}, timeout=30).json()
    return torch.tensor(body, dtype=torch.float32)


def version_of(url: str) -> str:
    return str(httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"])


def produce(stream: BucketStream, buckets: list[Bucket], before: Callable[[int], None]) -> list[int]:
    """The gather's side: every bucket the stream asks for, a fresh copy each time; returns the indices asked."""
    asked: list[int] = []
    error: BaseException | None = None
    stream.start(len(buckets), sum(b.nbytes for b in buckets))
    try:
        while (i := stream.next_index()) >= 0:
            asked.append(i)
            before(i)
            stream.put(Bucket(buckets[i].names, [t.clone() for t in buckets[i].tensors], ""))
    except BaseException as exc:
        error = exc
        raise
    finally:
        stream.close(error)
    return asked


@pytest.mark.timeout(240)
async def test_a_server_killed_mid_stream_restarts_the_gather_and_a_failed_gather_changes_nothing(
    tiny_model: Path, tmp_path: Path
) -> None:
    with running_servers(tiny_model, tmp_path, 2) as (a, b):
        sender = WeightBroadcaster([a.url, b.url], bucket_mb=0.05, timeout_s=20)
        try:
            assert sorted((await sender.send_version(1, model_state(tiny_model, 0.01))).loaded) == sorted([a.url, b.url])

            # version 2, streamed: b dies once the stream asks for its third bucket
            v2 = model_state(tiny_model, 0.02)
            buckets = make_buckets(v2, torch.float32, sender.bucket_bytes, checksum=False)
            assert len(buckets) > 4
            largest = max(x.nbytes for x in buckets)

            def kill_b_once(i: int) -> None:
                if i == 2 and b.proc.poll() is None:
                    b.stop(signal.SIGKILL)

            stream = BucketStream(asyncio.get_running_loop())
            result, asked = await asyncio.gather(sender.send(2, stream), asyncio.to_thread(produce, stream, buckets, kill_b_once))
            assert result.loaded == [a.url] and b.url in result.failed and result.rebuilds == 1, result
            assert asked.count(0) == 2 and asked[-len(buckets):] == list(range(len(buckets)))  # gathered again, in full
            assert 0 < result.held_peak_bytes <= 2 * largest and result.buckets == len(buckets)
            assert version_of(a.url) == "2"
            for name in v2:
                assert torch.equal(served(a.url, name), v2[name]), name

            # version 3: the gather fails at its fourth bucket; nothing of version 3 is served
            def fail_at_3(i: int) -> None:
                if i == 3:
                    raise RuntimeError("gather failed on purpose")

            stream = BucketStream(asyncio.get_running_loop())
            v3 = make_buckets(model_state(tiny_model, 0.03), torch.float32, sender.bucket_bytes, checksum=False)
            sent, produced = await asyncio.gather(sender.send(3, stream), asyncio.to_thread(produce, stream, v3, fail_at_3),
                                                  return_exceptions=True)
            assert isinstance(sent, StreamClosed) and "gather failed on purpose" in str(sent), sent
            assert isinstance(produced, RuntimeError)
            assert version_of(a.url) == "2" and torch.equal(served(a.url, "model.norm.weight"), v2["model.norm.weight"])

            # the next version lands whole (a new group: a dropped what it held of version 3)
            v4 = model_state(tiny_model, 0.04)
            assert (await sender.send_version(4, v4)).loaded == [a.url]
            assert version_of(a.url) == "4"
            for name in v4:
                assert torch.equal(served(a.url, name), v4[name]), name

            # a version of at most two buckets is kept whole: its gather ends without waiting for the
            # sender (the training call does not wait for the wire), and it is then sent from memory
            v5 = model_state(tiny_model, 0.05)
            whole = make_buckets(v5, torch.float32, 1 << 30, checksum=False)
            assert len(whole) == 1
            stream = BucketStream(asyncio.get_running_loop())
            assert await asyncio.wait_for(asyncio.to_thread(produce, stream, whole, lambda i: None), 60) == [0]
            result = await sender.send(5, stream)
            assert result.loaded == [a.url] and result.held_peak_bytes == whole[0].nbytes
            assert version_of(a.url) == "5" and torch.equal(served(a.url, "model.norm.weight"), v5["model.norm.weight"])
        finally:
            await sender.aclose()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["broadcast", "colocated"])
async def test_broadcast_seconds_count_from_the_first_bucket_not_from_the_training_call(tiny_model: Path, tmp_path: Path,
                                                                                         kind: str) -> None:
    # The trainer opens the stream when its training call starts; the gather puts the first bucket only
    # once the step is done. `broadcast_seconds` used to count that whole wait (it equalled train_time_s).
    from services.weights.sender.colocated import ColocatedSender

    with running_servers(tiny_model, tmp_path, 1) as [server]:
        sender: WeightBroadcaster | ColocatedSender = (
            WeightBroadcaster([server.url], bucket_mb=0.05, timeout_s=20) if kind == "broadcast"
            else ColocatedSender([server.url], bucket_mb=0.05, timeout_s=20))
        try:
            buckets = make_buckets(model_state(tiny_model, 0.01), torch.float32, sender.bucket_bytes, checksum=False)
            stream = BucketStream(asyncio.get_running_loop())
            step_done = asyncio.Event()
            loop = asyncio.get_running_loop()
            first_put: list[float] = []

            def gather_after_the_step() -> list[int]:
                asyncio.run_coroutine_threadsafe(step_done.wait(), loop).result()
                first_put.append(time.perf_counter())
                return produce(stream, buckets, lambda i: None)

            async def training_step() -> None:
                await asyncio.sleep(0.5)  # the step's compute, which the sender must not count
                step_done.set()

            opened = time.perf_counter()
            result, _, _ = await asyncio.gather(sender.send(1, stream), asyncio.to_thread(gather_after_the_step), training_step())
            ended = time.perf_counter()
            assert result.loaded == [server.url] and version_of(server.url) == "1"
            assert result.seconds <= ended - first_put[0] < ended - opened - 0.4
        finally:
            await sender.aclose()
