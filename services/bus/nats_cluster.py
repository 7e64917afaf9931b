"""A JetStream cluster of nats-servers on one machine (loopback): each node its own client, cluster
and monitor port and its own store, with routes to every other node. For trying a cluster
(`jetrl nats --cluster 3`) and for the tests that kill a node mid-run. Production clusters use the
official Helm chart (`infra/k8s/nats-helm-values.yaml`); the services see the same thing either way:
a comma-separated list of URLs."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from services.bus.nats_server import ExitedEarly, NatsServer, free_port

NODE_CONF = """
server_name: {name}
cluster {{
  name: {cluster}
  listen: {host}:{cluster_port}
  routes: [{routes}]
  connect_retries: 120
}}
"""


class NatsCluster:
    def __init__(self, root: str | Path, size: int = 3, host: str = "127.0.0.1", name: str = "jetrl") -> None:
        if size < 1:
            raise ValueError(f"a cluster needs at least one node, got {size}")
        self.root = Path(root).resolve()
        self.host, self.name, self.size = host, name, size
        self.cluster_ports: list[int] = []
        self.nodes: list[NatsServer] = []
        self._place()

    def _place(self) -> None:
        """Pick every node's ports (client, monitor, cluster) and write their configuration."""
        host, name = self.host, self.name
        self.cluster_ports = [free_port(host) for _ in range(self.size)]
        routes = ", ".join(f"nats-route://{host}:{p}" for p in self.cluster_ports)
        self.nodes = [
            NatsServer(
                self.root / f"n{i}", host=host, log_file=self.root / f"n{i}.log",
                extra_conf=NODE_CONF.format(name=f"{name}-n{i}", cluster=name, host=host, cluster_port=port, routes=routes),
            )
            for i, port in enumerate(self.cluster_ports)
        ]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated: what `nats_url` takes."""
        return ",".join(self.urls)

    def node_named(self, server_name: str) -> NatsServer:
        for i, node in enumerate(self.nodes):
            if server_name == f"{self.name}-n{i}":
                return node
        raise KeyError(f"no node named {server_name!r} in cluster {self.name}")

    def start(self, timeout_s: float = 60.0, attempts: int = 3) -> NatsCluster:
        """Start every node (a node waits for its routes), then wait until JetStream has a meta leader.
        Ports picked by `free_port` can be taken by another process before a node binds them (two test
        runs side by side): if a node exits while starting, every node is stopped and the cluster starts
        again on fresh ports (the stores stay: the nodes know each other by name, not by port)."""
        if attempts < 1:
            raise ValueError(f"NatsCluster.start: attempts must be at least 1, got {attempts}")
        for _ in range(attempts - 1):
            try:
                return self._start_once(timeout_s)
            except ExitedEarly:
                self.stop()
                self._place()
        try:
            return self._start_once(timeout_s)
        except ExitedEarly:
            self.stop()
            raise

    def _start_once(self, timeout_s: float) -> NatsCluster:
        for node in self.nodes:
            node.start_detached()
        for node in self.nodes:
            node.wait_ready(timeout_s)
        self.wait_meta_leader(timeout_s)
        return self

    def wait_meta_leader(self, timeout_s: float = 60.0) -> str:
        """The meta leader's server name, once the cluster has elected one and every running node knows it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            leaders = {self._meta_leader(n) for n in self.nodes if n.proc is not None and n.proc.poll() is None}
            if len(leaders) == 1 and None not in leaders:
                return str(leaders.pop())
            time.sleep(0.1)  # polling the monitor endpoint, not waiting blindly
        raise TimeoutError(f"cluster {self.name}: no JetStream meta leader within {timeout_s}s; see {self.root}/n*.log")

    def _meta_leader(self, node: NatsServer) -> str | None:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{node.monitor_port}/jsz", timeout=1) as resp:
                info = json.load(resp)
        except OSError:
            return None
        return (info.get("meta_cluster") or {}).get("leader") or None

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
