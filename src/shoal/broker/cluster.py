"""A NATS cluster on this machine, for trying Shoal on several nodes, and the replicas a stream
or bucket gets on whatever cluster Shoal is connected to.

`LocalCluster(n)` runs `n` nats-server nodes on 127.0.0.1, JetStream on, joined by routes
(`--cluster_name shoal`), each with its own store and a name (`node1` ...), which JetStream
needs to place replicas. Clients take every node's URL (`cluster.url`, comma-separated) and
move to another node when theirs goes away. A node stopped or killed can be started again
on its ports and store, and rejoins.

Streams and buckets are made with `stream_replicas(js)` replicas: `SHOAL_REPLICAS` when set,
else min(3, the cluster's size as its servers advertise it), so a three-node cluster keeps
every queued request on three nodes and loses none when one of them dies.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from nats.js import JetStreamContext

from shoal.broker.embedded import EmbeddedNats
from shoal.config import env_default
from shoal.process import free_ports

log = logging.getLogger(__name__)

CLUSTER_NAME = "shoal"
MAX_REPLICAS = 3  # JetStream's usual replication; more costs writes and buys little


class LocalCluster:
    """`nodes` nats-server processes on 127.0.0.1, routed into one JetStream cluster."""

    def __init__(
        self, nodes: int, store_dir: Path | None = None, config_file: Path | None = None
    ) -> None:
        if nodes < 1:
            raise ValueError("a cluster has at least one node")
        root = Path(store_dir or tempfile.mkdtemp(prefix="shoal-nats-cluster-"))
        ports = free_ports(2 * nodes)
        route_ports, client_ports = ports[:nodes], ports[nodes:]
        routes = ",".join(f"nats://127.0.0.1:{port}" for port in route_ports)
        self.nodes = [
            EmbeddedNats(
                store_dir=root / f"node{index + 1}",
                port=client_ports[index],
                config_file=config_file,  # the users and permissions, as on one server
                extra_args=node_args(index, f"nats://127.0.0.1:{route_ports[index]}", routes),
            )
            for index in range(nodes)
        ]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated, as `--nats` takes them."""
        return ",".join(f"nats://127.0.0.1:{node.port}" for node in self.nodes)

    def start(self, timeout: float = 20.0) -> str:
        for node in self.nodes:
            node.start(timeout)
        return self.url

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def node_named(self, name: str) -> EmbeddedNats:
        """The node a server name (`node2`) names, as JetStream reports leaders."""
        return self.nodes[int(name.removeprefix("node")) - 1]

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def node_args(index: int, route_url: str, routes: str) -> list[str]:
    """nats-server flags for node `index` (from 0) of a cluster: its name (`node1` ...), the
    cluster's, where it listens for routes, and every node's route URL (comma-separated)."""
    name = f"node{index + 1}"
    return ["-n", name, "--cluster_name", CLUSTER_NAME, "--cluster", route_url, "--routes", routes]


def cluster_size(js: JetStreamContext) -> int:
    """How many servers the connected one says its cluster has (1 for a lone server)."""
    info = getattr(js._nc, "_server_info", None) or {}  # nats.py keeps the server's INFO here
    return max(1, len(info.get("connect_urls") or []))


def stream_replicas(js: JetStreamContext) -> int:
    """Replicas for a new stream or bucket: `SHOAL_REPLICAS`, else min(3, cluster size)."""
    configured = env_default("REPLICAS", 0)
    return configured if configured > 0 else min(MAX_REPLICAS, cluster_size(js))


def report_replicas(name: str, replicas: int, wanted: int) -> None:
    """A stream or bucket made earlier with fewer replicas is kept, and said so."""
    if replicas < wanted:
        log.warning(
            "%s has %d replica(s) but this cluster would give it %d: it was made on a smaller "
            "cluster. Queued work there is lost with the node that holds it; recreate it "
            "(nats stream edit --replicas %d, or delete it while idle) to replicate it.",
            name,
            replicas,
            wanted,
            wanted,
        )
