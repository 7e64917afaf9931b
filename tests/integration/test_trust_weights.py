"""A weights agent acts only on announcements the trainer signed and that name weights under its
roots: a real nats-server, a real CPU inference server and a real agent process. Forged
announcements (unsigned, signed under another key, or signed but pointing at `file:///etc` with the
true sha256 of /etc/passwd) are each refused before anything is read or paused, counted, reported as
`WeightsLoadFailed` naming only the cause (no path, no size), and the server keeps serving."""

from __future__ import annotations

import hashlib
from pathlib import Path

import nats
import pytest

from schemas.messages import WeightFile, WeightsLoaded, WeightsLoadFailed, WeightsPublished, encode
from schemas.subjects import Subjects
from services.common.nats_server import free_port
from services.status.weights import weights_status
from services.weights.sender.publisher import WeightPublisher, ensure_weight_sync_stream
from services.weights.trust import sign
from tests.support.weights import Stack, make_version, process, server_version, wait_healthy

RUN = "wtrust"
KEY = b"the-trainers-announce-key"


async def _announce(nc: nats.aio.client.Client, msg: WeightsPublished) -> None:
    await nc.jetstream().publish(Subjects(RUN).weights_published, encode(msg))


@pytest.mark.timeout(180)
async def test_forged_and_out_of_root_announcements_are_refused(nats_url: str, tmp_path: Path, tiny_model: Path) -> None:
    nc = await nats.connect(nats_url)
    await ensure_weight_sync_stream(nc)
    stack = Stack(nats_url, RUN, tmp_path, tiny_model)
    await stack.watch(nc)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    key_file = tmp_path / "announce.key"
    key_file.write_bytes(KEY + b"\n")
    agent = [*stack.agent_args(url, 0), f"trust.announce_key_file={key_file}"]
    try:
        with (
            process(stack.server_args(port), tmp_path / "s.log") as server,
            process(agent, tmp_path / "a.log"),
        ):
            await wait_healthy(url, server, tmp_path / "s.log")
            trainer = WeightPublisher(nc, RUN, keep_last=2, announce_key=KEY)
            await trainer.publish_dir(1, 1, make_version(tiny_model, tmp_path / "c1", 1))
            await stack.expect(WeightsLoaded, 1, 1)

            # a real checkpoint in a directory, announced unsigned, then under another key
            forged_dir = make_version(tiny_model, tmp_path / "forged" / "v999999", 9)
            files = [WeightFile(name=p.name, sha256=hashlib.sha256(p.read_bytes()).hexdigest(), size=p.stat().st_size)
                     for p in sorted(forged_dir.iterdir())]
            forged = WeightsPublished(run=RUN, version=999999, uri=forged_dir.as_uri(), files=files, step=999999)
            await _announce(nc, forged)
            [unsigned] = await stack.expect(WeightsLoadFailed, 999999, 1)
            await _announce(nc, sign(forged.model_copy(update={"version": 1000000}), b"guessed-key"))
            [bad] = await stack.expect(WeightsLoadFailed, 1000000, 1)
            assert "not signed" in unsigned.reason and "signature" in bad.reason

            # signed (a trainer's key leaked, or a trainer misconfigured), but outside the roots
            passwd = Path("/etc/passwd")
            etc = WeightsPublished(run=RUN, version=1000001, uri="file:///etc", step=1000001, files=[
                WeightFile(name="passwd", sha256=hashlib.sha256(passwd.read_bytes()).hexdigest(), size=passwd.stat().st_size)])
            await _announce(nc, sign(etc, KEY))
            [outside] = await stack.expect(WeightsLoadFailed, 1000001, 1)
            assert "outside" in outside.reason
            for report in (unsigned, bad, outside):  # nothing about the files goes out on the bus
                assert "/" not in report.reason and str(passwd.stat().st_size) not in report.reason, report.reason

            assert await server_version(url) == "1", "the server kept the trainer's weights"
            status = await weights_status(nc, RUN)
            assert [(s.loaded_version, s.failed_version) for s in status.servers] == [(1, 1000001)]

            # the trainer's next version still goes through
            await trainer.publish_dir(2, 2, make_version(tiny_model, tmp_path / "c2", 2))
            await stack.expect(WeightsLoaded, 2, 1)
            assert await server_version(url) == "2"
        log = (tmp_path / "a.log").read_text()
        assert log.count("weights announcement refused") == 3
        assert KEY.decode() not in log
    finally:
        await nc.close()
