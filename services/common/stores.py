"""torch.distributed stores that listen only where they must.

A master `TCPStore` listens on every interface (`::`) whatever host it is given: anyone who reaches
the port could read and write the rendezvous of the trainer's ranks or of the weight-broadcast
group. Here the listening socket is made by us, bound to the address the other members dial
(loopback by default; the pod's own address in Kubernetes), and handed to the store.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch.distributed as dist

AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
"""Set by torchrun when its agent process already serves the store (then it is torchrun's to bind)."""


def listening_store(host: str, port: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """A master TCPStore listening on `host` only (`port` 0: a free one, `store.port` says which)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(max(128, world_size))
        bound = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # the store takes the descriptor over (detach: Python must not close it when `sock` goes)
    return dist.TCPStore(host, bound, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def init_default_group(backend: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> None:
    """The default process group from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, as `env://` would
    make it, except that rank 0's store listens on MASTER_ADDR only. Under torchrun's agent store
    (`TORCHELASTIC_USE_AGENT_STORE`) nothing is done here: `env://` then joins torchrun's store."""
    if dist.is_initialized() or os.environ.get(AGENT_STORE) == "True":
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        store = listening_store(host, port, world, timeout)
    else:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
