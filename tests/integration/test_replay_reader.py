"""The range reader, export and import against a real nats-server (no training): ranges by sequence,
time and kind in stream order, other runs ignored, reading while a live run writes (or deletes the
range's last message), a lost consumer
recreated without gaps or repeats (while reading, and while waiting for a live run), and a recording
moved through Parquet into another run unchanged."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from schemas.headers import trajectory_headers
from schemas.subjects import TRAJECTORIES_STREAM, Subjects
from schemas.trajectory import decode_group, encode_group, group_to_table
from services.common.bus import connect, declare_streams
from services.replay.export import export_range
from services.replay.import_ import import_files
from services.replay.reader import StreamReader
from services.replay.settings import ExportSettings, ImportSettings, RangeSettings
from tests.unit.test_replay_units import ragged_group

LIVE = "live"


async def publish(js: Any, run: str, i: int, *, is_eval: bool = False) -> int:
    tensors = ragged_group(i)
    pid = f"{'e' if is_eval else 'p'}{i}"
    _, meta = group_to_table(tensors, run=run, prompt_id=pid, worker="w", is_eval=is_eval)
    subject = Subjects(run).trajectories_eval if is_eval else Subjects(run).trajectories
    ack = await js.publish(subject, encode_group(tensors, run=run, prompt_id=pid, worker="w", is_eval=is_eval),
                           headers=trajectory_headers(meta), stream=TRAJECTORIES_STREAM)
    return ack.seq


async def read(js: Any, run: str, rng: RangeSettings, **kw: Any) -> list[Any]:
    return [r async for r in StreamReader(js, run, rng, **kw)]


@pytest.fixture
async def js(nats_url: str) -> Any:
    nc = await connect(nats_url, "test")
    await declare_streams(nc.jetstream())
    yield nc.jetstream()
    await nc.close()


@pytest.mark.timeout(60)
async def test_ranges_by_sequence_time_and_kind(js: Any) -> None:
    train, evals = [], []
    for i in range(8):
        train.append(await publish(js, LIVE, i))
        await publish(js, "other", i)  # another run on the same stream: never read
        if i % 3 == 0:
            evals.append(await publish(js, LIVE, i, is_eval=True))
    everything = await read(js, LIVE, RangeSettings(), batch=3)
    assert [r.seq for r in everything] == train
    assert [decode_group(r.data).meta.prompt_id for r in everything] == [f"p{i}" for i in range(8)]
    assert [r.seq for r in await read(js, LIVE, RangeSettings(kind="eval"))] == evals
    assert [r.seq for r in await read(js, LIVE, RangeSettings(kind="all"))] == sorted(train + evals)
    assert [r.seq for r in await read(js, LIVE, RangeSettings(from_seq=train[2], to_seq=train[5]))] == train[2:6]
    # by time: the 3rd to the 6th message (timestamps reach the client as float seconds: a microsecond of slack)
    slack = timedelta(microseconds=1)
    by_time = await read(js, LIVE, RangeSettings(since=everything[2].time - slack, until=everything[5].time + slack))
    assert [r.seq for r in by_time] == train[2:6]
    # an empty range ends at once: starting after the stream, or after the range's newest message (the
    # other run's messages come later)
    assert await read(js, LIVE, RangeSettings(from_seq=train[-1] + 100)) == []
    assert await read(js, LIVE, RangeSettings(since=everything[-1].time + slack)) == []
    # resume after a checkpoint's sequence
    assert [r.seq for r in await read(js, LIVE, RangeSettings(), start_after=train[4])] == train[5:]


@pytest.mark.timeout(60)
async def test_reading_while_a_live_run_writes(js: Any) -> None:
    first = [await publish(js, LIVE, i) for i in range(3)]

    async def live_run() -> list[int]:
        return [await publish(js, LIVE, i) for i in range(3, 9)]

    # without follow, the range is what was there when reading started, however much is written meanwhile
    records = aiter(StreamReader(js, LIVE, RangeSettings(), batch=1))
    got = [(await anext(records)).seq]  # reading has started: the range is fixed now
    writer = asyncio.create_task(live_run())
    got += [r.seq async for r in records]
    later = await writer
    assert got == first
    # with follow and an end, the reader waits for the live run to get there
    follow = StreamReader(js, LIVE, RangeSettings(from_seq=first[1], to_seq=later[-1] + 2, follow=True), batch=2,
                          fetch_timeout_s=0.2)
    task = asyncio.create_task(read_all(follow))
    more = [await publish(js, LIVE, i) for i in range(9, 13)]
    assert await asyncio.wait_for(task, 20) == first[1:] + later + more[:2]


@pytest.mark.timeout(60)
async def test_a_range_whose_last_message_is_deleted_while_reading_ends_at_what_is_left(js: Any) -> None:
    seqs = [await publish(js, LIVE, i) for i in range(4)]
    records = aiter(StreamReader(js, LIVE, RangeSettings(), batch=1, fetch_timeout_s=0.2))
    got = [(await anext(records)).seq]  # the range is fixed: it ends at seqs[-1]
    await js.delete_msg(TRAJECTORIES_STREAM, seqs[-1])
    got += [r.seq async for r in records]
    assert got == seqs[:-1]


async def read_all(reader: StreamReader) -> list[int]:
    return [r.seq async for r in reader]


@pytest.mark.timeout(60)
async def test_a_lost_consumer_is_recreated_after_the_last_sequence(js: Any) -> None:
    seqs = [await publish(js, LIVE, i) for i in range(6)]
    reader = StreamReader(js, LIVE, RangeSettings(), batch=2, fetch_timeout_s=0.5)
    got = []
    async for record in reader:
        got.append(record.seq)
        if len(got) == 2:  # e.g. the server dropped it as inactive during a long training step
            await js.delete_consumer(TRAJECTORIES_STREAM, reader.consumer)
    assert got == seqs and reader.resets >= 1


@pytest.mark.timeout(60)
async def test_a_consumer_lost_while_waiting_for_a_live_run_is_recreated(js: Any) -> None:
    first = [await publish(js, LIVE, i) for i in range(2)]
    reader = StreamReader(js, LIVE, RangeSettings(from_seq=first[0], to_seq=first[0] + 3, follow=True), batch=2,
                          fetch_timeout_s=2.0)
    records = aiter(reader)
    got = [(await anext(records)).seq for _ in range(2)]
    waiting = asyncio.ensure_future(anext(records))  # the reader's pull now waits for the live run
    for _ in range(200):  # until the server holds the reader's pull request
        if (await js.consumer_info(TRAJECTORIES_STREAM, reader.consumer)).num_waiting:
            break
        await asyncio.sleep(0.05)  # polling the consumer's state, not waiting blindly
    else:
        pytest.fail("the reader's pull never reached the server")
    await js.delete_consumer(TRAJECTORIES_STREAM, reader.consumer)
    later = [await publish(js, LIVE, i) for i in range(2, 4)]
    got += [(await asyncio.wait_for(waiting, 20)).seq, (await asyncio.wait_for(anext(records), 20)).seq]
    assert got == first + later and reader.resets == 1
    await records.aclose()  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
async def test_export_then_import_moves_a_recording_unchanged(js: Any, nats_url: str, tmp_path: Path) -> None:
    seqs = [await publish(js, LIVE, i) for i in range(5)]
    await js.publish(Subjects(LIVE).trajectories, b"corrupt", stream=TRAJECTORIES_STREAM)
    await publish(js, LIVE, 5, is_eval=True)
    original = {
        decode_group(r.data).meta.prompt_id: decode_group(r.data).tensors
        for r in await read(js, LIVE, RangeSettings(kind="all"))
        if r.data != b"corrupt"
    }

    out = tmp_path / "rec.parquet"
    res = await export_range(js, ExportSettings(run=LIVE, nats_url=nats_url, output=str(out), range=RangeSettings(kind="all")))
    assert res.groups == 6 and res.malformed == 1 and out.exists() and not out.with_name("rec.parquet.partial").exists()

    # into another run (another cluster would be another nats_url): same groups, same order, eval stays eval
    imported = await import_files(js, ImportSettings(run="copy", nats_url=nats_url, input=[str(tmp_path)]))
    assert imported.groups == 6 and imported.duplicates == 0
    copied = await read(js, "copy", RangeSettings(kind="all"))
    assert [decode_group(r.data).meta.prompt_id for r in copied] == [f"p{i}" for i in range(5)] + ["e5"]
    assert copied[-1].subject == Subjects("copy").trajectories_eval
    for r in copied:
        back = decode_group(r.data)
        want = original[back.meta.prompt_id]
        assert all(back.tensors[k].dtype == want[k].dtype and (back.tensors[k] == want[k]).all() for k in want)
    # importing the same file again is de-duplicated by Nats-Msg-Id
    again = await import_files(js, ImportSettings(run="copy", nats_url=nats_url, input=[str(out)]))
    assert again.duplicates == 6
    assert len(await read(js, "copy", RangeSettings(kind="all"))) == 6
    # a train-only export of a sequence range holds exactly that range
    part = await export_range(js, ExportSettings(run=LIVE, nats_url=nats_url, output=str(tmp_path / "part.parquet"),
                                                 range=RangeSettings(from_seq=seqs[1], to_seq=seqs[3])))
    assert part.groups == 3 and part.rows == 9
