"""`jetrl nats`: an embedded nats-server with JetStream and a file store, or with `--cluster N` a
JetStream cluster of N nodes on loopback."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Callable

from services.bus.nats_cluster import NatsCluster
from services.bus.nats_server import NatsServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jetrl nats", description="Run an embedded nats-server with JetStream.")
    parser.add_argument(
        "--store-dir",
        default=os.environ.get("JETRL_NATS__STORE_DIR", ".jetrl/nats"),
        help="JetStream file store directory",
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address")
    parser.add_argument("--port", type=int, default=4222, help="client port")
    parser.add_argument("--monitor-port", type=int, default=8222, help="HTTP monitoring port (/healthz)")
    parser.add_argument("--max-payload", default="8MB", help="largest message (JetStream caps at 32MB)")
    parser.add_argument("--cluster", type=int, default=0, metavar="N",
                        help="run a JetStream cluster of N nodes on free loopback ports instead (stores under --store-dir)")
    args = parser.parse_args(argv)
    if args.cluster:
        return _run_cluster(args.store_dir, args.cluster, args.host)
    server = NatsServer(args.store_dir, args.port, args.host, args.monitor_port, args.max_payload)
    server.start()
    print(f"nats-server ready at {server.url} (store {server.store_dir}, log {server.log_file})", flush=True)
    _until_stopped(lambda: server.proc is not None and server.proc.poll() is None)
    server.stop()
    return 0


def _run_cluster(store_dir: str, size: int, host: str) -> int:
    cluster = NatsCluster(store_dir, size, host).start()
    print(f"JetStream cluster of {size} ready; give every service nats_url={cluster.url} nats_replicas={min(size, 3)}", flush=True)
    for i, node in enumerate(cluster.nodes):
        monitor = f"http://{host}:{node.monitor_port}"
        print(f"  node n{i}: {node.url} (store {node.store_dir}, log {node.log_file}, monitor {monitor})", flush=True)
    _until_stopped(lambda: True)
    cluster.stop()
    return 0


def _until_stopped(alive: Callable[[], bool]) -> None:
    """Until SIGTERM or SIGINT, or until `alive()` (checked every 0.5 s) is false."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while alive() and not stop.wait(0.5):
        pass
