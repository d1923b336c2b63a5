"""Process-level setup shared by Shoal's processes: child-process hygiene for everything that
starts processes (and the ports their children bind), and the garbage collector's setting for
those that serve requests."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import random
import signal
import socket
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def child_preexec() -> None:
    """Runs in a child before exec: the child gets SIGTERM if its parent dies.

    So a supervisor killed with SIGKILL still leaves no nats-server, gateway or worker behind.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# Ports handed to children come from here up to the kernel's ephemeral range (below).
FIRST_CHILD_PORT = 20_000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PORT_TRIES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing holds now, for a child process to bind (see
    `free_ports`, which a caller wanting several at once must use)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` different TCP ports on `host` that nothing holds now, for child processes to
    bind.

    They are chosen below the kernel's ephemeral range where there is one: a port from
    bind(0) is an ephemeral port, which any outgoing connection (a load client's, a NATS
    client's) may take as its own local port between this probe and the child's bind. Each
    probe's socket stays bound until all are chosen, so no two are the same (picked one at a
    time, 25 random ports for a push cluster collide about 2% of the time, and a benchmark's
    push cluster lost a worker to "address already in use" on such a port). Falls back to
    bind(0) where no such port is free.
    """
    first_ephemeral = _first_ephemeral_port()
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(count):
            sock = held.enter_context(socket.socket())
            ports.append(_bind_one(sock, host, first_ephemeral))
        return ports


def _bind_one(sock: socket.socket, host: str, first_ephemeral: int) -> int:
    # No SO_REUSEADDR: a port with connections still in TIME_WAIT is refused too, so a child
    # that binds without the option finds it free as well.
    if first_ephemeral > FIRST_CHILD_PORT:
        for _ in range(_PORT_TRIES):
            port = random.randrange(FIRST_CHILD_PORT, first_ephemeral)
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    sock.bind((host, 0))
    return sock.getsockname()[1]


def _first_ephemeral_port() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: no range to stay below
        return 0


# CPython runs a young-generation collection whenever the container objects allocated and not
# yet freed pass this count. Its default, 700, is below what a loaded gateway or worker holds
# for its requests in flight (a request's scope, task, futures and structs), so the count
# passed it every few requests: the gateway ran ~110 collections a second at 6,000-7,600
# requests/s and spent 9-10% of its CPU in them (timed with gc.callbacks under bench.hotpath's
# load; docs/benchmarks.md, "The garbage collector"). Above the working set, the count rises
# only with objects that outlive their request, and collections become rare.
YOUNG_GENERATION_THRESHOLD = 10_000


def tune_garbage_collector() -> None:
    """Raise the young generation's collection threshold (`YOUNG_GENERATION_THRESHOLD`) in a
    process that serves requests; the older generations keep their ratios."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, older, oldest)
