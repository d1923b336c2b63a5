"""A three-node NATS cluster loses a node under load, and no request.

Three nats-server nodes on loopback (`LocalCluster`), a gateway and a worker given all three
URLs, the SIMULATED accelerator (runtime `sim`). While clients send requests, the node that
leads the work stream is killed with SIGKILL, and later started again. Every request must end
in its one correct answer: a client told to retry (503 while its gateway moves to another node)
retries with the same Idempotency-Key, as a careful client does. The stream and the buckets
are replicated on three nodes, so nothing queued is lost with the node.

The same scenario runs twice: on loopback, and with each node in its own network namespace
(`ip netns`, joined by veth pairs on a bridge), so the routes between nodes and the clients'
connections cross real interfaces and the killed node's peers see a remote host go silent.
The second skips, with the reason, where network namespaces cannot be made (not root, no
`ip`, a container that forbids them).
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import wait_until

from shoal.broker.cluster import LocalCluster, node_args
from shoal.broker.connection import connect
from shoal.broker.embedded import EmbeddedNats
from shoal.protocol import WORK_STREAM
from shoal.runtimes.sim import pseudo_embedding

MODEL = "sim-cluster"
REQUESTS = 600
CONCURRENCY = 16


@pytest.fixture
def cluster(tmp_path):
    nodes = LocalCluster(3, tmp_path / "nats")
    nodes.start()
    try:
        wait_until(lambda: _cluster_formed(nodes.url), 30)
        yield nodes
    finally:
        nodes.stop()


def _cluster_formed(url: str) -> bool:
    async def check() -> bool:
        nc = await connect(url, name="test")
        try:
            if len(nc._server_info.get("connect_urls") or []) < 3:
                return False
            await nc.jetstream().account_info()  # a JetStream meta leader is elected
            return True
        except Exception:
            return False
        finally:
            await nc.close()

    return asyncio.run(check())


def _stream_cluster(url: str):
    async def read():
        nc = await connect(url, name="test")
        try:
            return (await nc.jetstream().stream_info(WORK_STREAM)).cluster
        finally:
            await nc.close()

    return asyncio.run(read())


async def _send_all(url: str, texts: list[str], sent: list[int]) -> list[httpx.Response]:
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def one(index: int, text: str) -> httpx.Response:
            body = {"model": MODEL, "input": text, "encoding_format": "base64"}
            headers = {"Idempotency-Key": f"cluster-{index}"}
            async with semaphore:
                for _ in range(100):
                    try:
                        response = await client.post("/v1/embeddings", json=body, headers=headers)
                    except httpx.TransportError:
                        await asyncio.sleep(0.2)
                        continue
                    if response.status_code not in (429, 503):
                        sent.append(index)
                        return response
                    await asyncio.sleep(0.2)  # told to retry
            raise AssertionError(f"request {index} was never answered")

        return await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))


def test_a_killed_stream_leader_loses_no_request_and_rejoins(cluster, launcher):
    _leader_killed_under_load(cluster, launcher)


def test_across_network_namespaces_a_killed_leader_loses_no_request(netns_cluster, launcher):
    _leader_killed_under_load(netns_cluster, launcher)


def _leader_killed_under_load(cluster: LocalCluster | NetnsCluster, launcher) -> None:
    _, url = launcher.gateway(cluster.url)
    launcher.worker(cluster.url, MODEL, "--runtime", "sim", "--option", "batch_ms=20")
    replicated = _stream_cluster(cluster.url)
    assert replicated is not None and len(replicated.replicas or []) == 2, replicated
    leader = cluster.node_named(replicated.leader)

    texts = [f"clustered sentence {i}" for i in range(REQUESTS)]
    answered: list[int] = []
    answered_before_kill: list[int] = []

    async def scenario() -> list[httpx.Response]:
        load = asyncio.ensure_future(_send_all(url, texts, answered))
        while len(answered) < REQUESTS // 3:
            await asyncio.sleep(0.05)
        os.kill(leader.pid, signal.SIGKILL)  # mid-load, without warning
        answered_before_kill.append(len(answered))
        return await load

    responses = asyncio.run(scenario())
    for text, response in zip(texts, responses, strict=True):
        assert response.status_code == 200, response.text
        vector = np.frombuffer(base64.b64decode(response.json()["data"][0]["embedding"]), "<f4")
        np.testing.assert_allclose(vector, pseudo_embedding(text, 384), rtol=0, atol=1e-6)
    assert sorted(answered) == list(range(REQUESTS))  # each exactly once
    assert answered_before_kill[0] < REQUESTS - 100  # most of the load came after the kill

    # A new leader took over; the killed node comes back on its ports and store and catches up.
    after = _stream_cluster(cluster.url)
    assert after.leader != replicated.leader
    leader.start()
    wait_until(
        lambda: (
            all(peer.current for peer in (_stream_cluster(cluster.url).replicas or []))
            and len(_stream_cluster(cluster.url).replicas or []) == 2
        ),
        60,
    )


class NetnsCluster:
    """Three nats-server nodes, each in its own network namespace on a bridge in this one.

    Node i has 10.X.Y.(10+i) on the veth end inside its namespace; the bridge has 10.X.Y.1, so
    this namespace (the gateway, the worker, the test) reaches every node through it. Every
    node listens on the same ports, 4222 for clients and 6222 for routes: each namespace has
    its own. As `LocalCluster` for the scenario: `url`, `nodes`, `node_named`.
    """

    CLIENT_PORT = 4222
    ROUTE_PORT = 6222

    def __init__(self, store_dir: Path, nodes: int = 3) -> None:
        tag = f"{os.getpid() % 100_000:05d}"
        self.prefix = f"{int(tag[:2]) % 50 + 200}.{int(tag[2:]) % 250}"  # 10.200-249.0-249
        self.bridge = f"shbr{tag}"
        self.namespaces = [f"shoal-{tag}-{index + 1}" for index in range(nodes)]
        self.hosts = [f"10.{self.prefix}.{index + 11}" for index in range(nodes)]
        routes = ",".join(f"nats://{host}:{self.ROUTE_PORT}" for host in self.hosts)
        self.nodes = [
            EmbeddedNats(
                store_dir=store_dir / f"node{index + 1}",
                port=self.CLIENT_PORT,
                host=host,
                launcher=["ip", "netns", "exec", namespace],
                extra_args=node_args(index, f"nats://{host}:{self.ROUTE_PORT}", routes),
            )
            for index, (host, namespace) in enumerate(zip(self.hosts, self.namespaces, strict=True))
        ]

    @property
    def url(self) -> str:
        return ",".join(f"nats://{host}:{self.CLIENT_PORT}" for host in self.hosts)

    def node_named(self, name: str) -> EmbeddedNats:
        return self.nodes[int(name.removeprefix("node")) - 1]

    def create_network(self) -> None:
        """The bridge, and a namespace per node wired to it; raises CalledProcessError."""
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"10.{self.prefix}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index, (namespace, host) in enumerate(zip(self.namespaces, self.hosts, strict=True)):
            outside, inside = f"{self.bridge}o{index}", f"{self.bridge}i{index}"
            _ip("netns", "add", namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{host}/24", "dev", inside)
            _ip("-n", namespace, "link", "set", inside, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")

    def start(self, timeout: float = 20.0) -> None:
        for node in self.nodes:
            node.start(timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def remove_network(self) -> None:
        # Deleting a namespace deletes the veth end inside it, and so its peer on the bridge.
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, check=True, timeout=10)


def _reaches(namespace: str, host: str, port: int) -> bool:
    """Whether a TCP connection from `namespace` to host:port succeeds (bash's /dev/tcp)."""
    probe = f"exec 3<>/dev/tcp/{host}/{port}"
    command = ["ip", "netns", "exec", namespace, "bash", "-c", probe]
    return subprocess.run(command, capture_output=True, timeout=10, check=False).returncode == 0


@pytest.fixture
def netns_cluster(tmp_path):
    if shutil.which("ip") is None or shutil.which("bash") is None:
        pytest.skip("network namespaces need the `ip` command (iproute2) and bash")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    nodes = NetnsCluster(tmp_path / "nats")
    try:
        try:
            nodes.create_network()
        except subprocess.CalledProcessError as err:
            pytest.skip(f"network namespaces are not permitted here: {err.stderr.decode().strip()}")
        nodes.start()
        # Traffic between namespaces crosses the bridge; a firewall that drops it is no test.
        if not _reaches(nodes.namespaces[0], nodes.hosts[1], NetnsCluster.CLIENT_PORT):
            pytest.skip("the bridge between network namespaces does not pass traffic here")
        wait_until(lambda: _cluster_formed(nodes.url), 30)
        yield nodes
    finally:
        nodes.stop()
        nodes.remove_network()
