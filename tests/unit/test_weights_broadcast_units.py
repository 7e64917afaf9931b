"""The weight-sync settings (and their old spelling), the broadcast's buckets, without processes."""

from __future__ import annotations

import pytest
import torch

from schemas.bucket_checksum import bucket_checksum
from services.common.settings import SettingsError, load_settings
from services.replay.settings import ReplaySettings
from services.trainer.settings import TrainerSettings
from services.weights.sender.buckets import make_buckets
from services.weights.sender.settings import BroadcastSync, ColocatedSync, NoSync, SharedDirSync, StoreSync


def test_servers_are_a_list_or_comma_separated_and_must_be_urls() -> None:
    s = load_settings(TrainerSettings, None, ["weights.transport=broadcast", "weights.servers=http://a:1/, http://b:2"])
    assert isinstance(s.weights, BroadcastSync) and s.weights.servers == ["http://a:1", "http://b:2"]
    with pytest.raises(SettingsError, match="not an http"):
        load_settings(TrainerSettings, None, ["weights.transport=colocated", "weights.servers=a:1"])
    with pytest.raises(SettingsError, match="servers is empty"):
        load_settings(TrainerSettings, None, ["weights.transport=broadcast"])


def test_one_weights_setting_names_the_transport_and_holds_only_its_own_settings() -> None:
    assert isinstance(TrainerSettings().weights, StoreSync)  # the default
    assert load_settings(TrainerSettings, None, ["weights.keep_last=5"]).weights == StoreSync(keep_last=5)
    shared = load_settings(TrainerSettings, None, ["weights.transport=shared_dir", "weights.dir=/w"]).weights
    assert isinstance(shared, SharedDirSync) and shared.dir == "/w"
    with pytest.raises(SettingsError, match=r"weights\.store\.servers: unknown key"):
        load_settings(TrainerSettings, None, ["weights.servers=http://a:1"])  # store sends to no server
    with pytest.raises(SettingsError, match="does not match any of the expected tags"):
        load_settings(TrainerSettings, None, ["weights.transport=carrier-pigeon"])
    assert isinstance(ReplaySettings(source_run="rec").weights, NoSync)  # a replay publishes nothing unless asked


def test_the_old_flat_weight_settings_are_read_as_weights_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match="weights_shared_dir, weights_broadcast: deprecated"):
        s = load_settings(TrainerSettings, None, ["weights_broadcast.enabled=true", "weights_broadcast.transport=colocated",
                                                  "weights_broadcast.servers=http://a:1", "weights_shared_dir=/w",
                                                  "weights_broadcast.disk_every=2"])
    assert s.weights == ColocatedSync(servers=["http://a:1"], disk_dir="/w", disk_every=2)
    with pytest.warns(FutureWarning):
        assert isinstance(load_settings(TrainerSettings, None, ["publish_weights=false"]).weights, NoSync)
    with pytest.warns(FutureWarning):
        assert load_settings(TrainerSettings, None, ["weights_shared_dir=/w", "weights_keep_last=4"]).weights == \
            SharedDirSync(dir="/w", keep_last=4)
    with pytest.warns(FutureWarning):  # broadcast off: its other settings were never read
        assert load_settings(TrainerSettings, None, ["weights_broadcast.bucket_mb=1"]).weights == StoreSync()
    with pytest.warns(FutureWarning):  # a replay did not publish unless asked
        assert ReplaySettings(source_run="rec", publish_weights=True).weights == StoreSync()
    with pytest.raises(SettingsError, match="both set"):
        load_settings(TrainerSettings, None, ["publish_weights=true", "weights.transport=store"])


def test_buckets_keep_order_respect_the_size_and_checksum_the_sent_bytes() -> None:
    state = {f"p{i}": torch.full((250,), float(i)) for i in range(10)}  # 1000 bytes each in fp32
    buckets = make_buckets(state, torch.bfloat16, bucket_bytes=1200)  # 500 bytes each in bf16: two per bucket
    assert [b.names for b in buckets] == [[f"p{i}", f"p{i + 1}"] for i in range(0, 10, 2)]
    assert all(t.dtype == torch.bfloat16 for b in buckets for t in b.tensors)
    assert buckets[0].checksum == bucket_checksum(buckets[0].tensors) != buckets[1].checksum
    flipped = [t.clone() for t in buckets[0].tensors]
    flipped[1].view(torch.int16)[3] ^= 1
    assert bucket_checksum(flipped) != buckets[0].checksum
    big = make_buckets({"a": torch.zeros(10), "huge": torch.zeros(1000), "b": torch.zeros(10)}, torch.float32, 100)
    assert [b.names for b in big] == [["a"], ["huge"], ["b"]]  # a tensor larger than a bucket is one of its own


def test_the_receiver_checks_a_bucket_with_the_algorithm_the_sender_announced() -> None:
    from schemas.bucket_checksum import check_bucket

    tensors = [torch.arange(1000, dtype=torch.float32), torch.ones(7, dtype=torch.bfloat16)]
    fast = bucket_checksum(tensors)
    assert fast.startswith("xxh3:")  # the default where xxhash is installed (it is in the dev set-up)
    crc = bucket_checksum(tensors, "crc32")
    assert crc.startswith("crc32:")
    assert check_bucket(tensors, fast) is None and check_bucket(tensors, crc) is None
    damaged = [tensors[0].clone(), tensors[1]]
    damaged[0].view(torch.int32)[500] ^= 1 << 7
    for announced in (fast, crc):
        why = check_bucket(damaged, announced)
        assert why is not None and why.startswith(f"bucket checksum mismatch: announced {announced}, received ")
    assert "unknown checksum algorithm 'md5'" in (check_bucket(tensors, "md5:abc") or "")
