"""torch.distributed stores listen on the configured address only (a plain master TCPStore listens on
every interface): the weight-broadcast group's store on `master_address`, the trainer's default
group's on MASTER_ADDR; members still rendezvous through them. Real TCPStores, sockets read back
from this process."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import psutil
import torch.distributed as dist

from services.common.stores import listening_store
from services.weights.sender.broadcast import WeightBroadcaster

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = datetime.timedelta(seconds=20)


def _listening_on(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_a_listening_store_binds_its_host_only_and_serves_its_members() -> None:
    store = listening_store("127.0.0.1", 0, 2, TIMEOUT)
    assert _listening_on(store.port) == {"127.0.0.1"}
    member = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=TIMEOUT)
    store.set("k", "v")
    assert member.get("k") == b"v"


def test_the_broadcast_groups_store_listens_on_master_address_only() -> None:
    sender = WeightBroadcaster(["http://127.0.0.1:1"], master_address="127.0.0.1", timeout_s=20)
    store = sender.group._open_store(2)
    assert _listening_on(store.port) == {"127.0.0.1"}, "listening beyond master_address"


def test_the_trainers_default_group_listens_on_master_addr_only() -> None:
    code = """
import os, psutil
from services.trainer.model.engine import init_distributed
init_distributed()
port = int(os.environ["MASTER_PORT"])
print(sorted({c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['127.0.0.1']", out.stdout
