"""WeightPublisher against a real nats-server: object store and shared directory, checksums, the
announcement a late reader sees, and garbage collection of old versions."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import nats
import pytest

from schemas.subjects import WEIGHTS_BUCKET
from services.common.busretry import RetryPolicy
from services.weights import objstore
from services.weights.agent import objread
from services.weights.files import parse_uri
from services.weights.sender.publisher import WeightPublisher


def make_checkpoint(root: Path, tag: str, big: int = 0) -> Path:
    """A minimal HF-shaped directory: config.json and a safetensors file (random bytes are enough for
    the publisher, which never parses them)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "tag": tag}))
    (root / "model.safetensors").write_bytes(os.urandom(big or 4096))
    return root


async def test_object_store_round_trip_is_bit_exact_and_larger_than_max_payload(nats_url: str, tmp_path: Path) -> None:
    nc = await nats.connect(nats_url)
    try:
        # 20 MiB + 3 bytes: above the server's 8 MB max_payload, not a multiple of the chunk size.
        ckpt = make_checkpoint(tmp_path / "ckpt", "a", big=20 * 1024 * 1024 + 3)
        pub = WeightPublisher(nc, "t1")
        msg = await pub.publish_dir(1, step=1, hf_dir=ckpt)
        assert msg.uri == f"nats-os://{WEIGHTS_BUCKET}/t1/v1"
        by_name = {f.name: f for f in msg.files}
        assert set(by_name) == {"config.json", "model.safetensors"}
        src = (ckpt / "model.safetensors").read_bytes()
        assert by_name["model.safetensors"].sha256 == hashlib.sha256(src).hexdigest()
        assert by_name["model.safetensors"].size == len(src)

        out = tmp_path / "got.bin"
        with open(out, "wb") as f:
            _, digest = await objread.get_file(nc.jetstream(), WEIGHTS_BUCKET, "t1/v1/model.safetensors", f, policy=RetryPolicy())
        assert out.read_bytes() == src
        assert digest == by_name["model.safetensors"].sha256
        # nats-py's own client reads our objects too (same wire format).
        store = await nc.jetstream().object_store(WEIGHTS_BUCKET)
        assert (await store.get("t1/v1/config.json")).data == (ckpt / "config.json").read_bytes()
    finally:
        await nc.close()


async def test_latest_and_keep_last_in_object_store(nats_url: str, tmp_path: Path) -> None:
    nc = await nats.connect(nats_url)
    try:
        pub = WeightPublisher(nc, "t2", keep_last=2)
        assert await pub.latest() is None
        for v in (1, 2, 3):
            await pub.publish_dir(v, step=v * 10, hf_dir=make_checkpoint(tmp_path / f"c{v}", str(v)))
        latest = await pub.latest()
        assert latest is not None and (latest.version, latest.step) == (3, 30)
        names = await objstore.list_names(nc.jetstream(), WEIGHTS_BUCKET)
        versions = sorted({n.split("/")[1] for n in names if n.startswith("t2/")})
        assert versions == ["v2", "v3"]
    finally:
        await nc.close()


async def test_shared_dir_copies_hashes_and_keeps_last(nats_url: str, tmp_path: Path) -> None:
    nc = await nats.connect(nats_url)
    try:
        shared = tmp_path / "shared"
        pub = WeightPublisher(nc, "t3", shared_dir=shared, keep_last=2)
        for v in (1, 2, 3):
            msg = await pub.publish_dir(v, step=v, hf_dir=make_checkpoint(tmp_path / f"c{v}", str(v)))
        where = parse_uri(msg.uri)
        assert where.scheme == "file" and where.path == shared.resolve() / "v3"
        for f in msg.files:
            assert hashlib.sha256((where.path / f.name).read_bytes()).hexdigest() == f.sha256
        assert sorted(p.name for p in shared.iterdir()) == ["v2", "v3"]
    finally:
        await nc.close()


async def test_shared_dir_takes_over_a_handed_over_dir_with_every_shard_hashed(nats_url: str, tmp_path: Path) -> None:
    """consume=True (the trainer's way): the directory is moved, not copied, and each of its shards
    is announced with its own size and sha256; without consume the source stays untouched."""
    nc = await nats.connect(nats_url)
    try:
        shared = tmp_path / "shared"
        pub = WeightPublisher(nc, "t5", shared_dir=shared, keep_last=2)
        src = make_checkpoint(tmp_path / "out" / "v1", "1")
        for i in (1, 2, 3):
            (src / f"model-0000{i}-of-00003.safetensors").write_bytes(os.urandom(1000 * i))
        inode = (src / "model-00002-of-00003.safetensors").stat().st_ino
        msg = await pub.publish_dir(1, step=1, hf_dir=src, consume=True)
        where = parse_uri(msg.uri)
        assert where.path is not None and not src.exists()
        assert (where.path / "model-00002-of-00003.safetensors").stat().st_ino == inode  # moved, not copied
        assert len(msg.files) == 5
        for f in msg.files:
            data = (where.path / f.name).read_bytes()
            assert (len(data), hashlib.sha256(data).hexdigest()) == (f.size, f.sha256)

        kept = make_checkpoint(tmp_path / "out" / "v2", "2")
        msg2 = await pub.publish_dir(2, step=2, hf_dir=kept)
        assert kept.exists() and [f.sha256 for f in msg2.files] == [
            hashlib.sha256((kept / f.name).read_bytes()).hexdigest() for f in msg2.files
        ]
    finally:
        await nc.close()


async def test_refuses_a_directory_that_is_not_a_checkpoint(nats_url: str, tmp_path: Path) -> None:
    nc = await nats.connect(nats_url)
    try:
        (tmp_path / "empty").mkdir()
        with pytest.raises(FileNotFoundError, match=r"config\.json"):
            await WeightPublisher(nc, "t4").publish_dir(1, step=1, hf_dir=tmp_path / "empty")
    finally:
        await nc.close()
