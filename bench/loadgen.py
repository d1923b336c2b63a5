"""Load generator for /v1/embeddings: open loop (Poisson arrivals) or closed loop (N clients).

    python -m bench.loadgen --url http://127.0.0.1:8000 --model sim-embed \\
        --mode open --rate 1000 --seconds 10 [--sizes small|mixed] [--dump FILE]
    python -m bench.loadgen --url ... --mode closed --connections 256 --seconds 10

Open loop: requests arrive at exponential intervals at a fixed mean rate, whatever the server
does; a request that finds no free connection waits in the client, and its latency counts
from its scheduled arrival (no coordinated omission). Closed loop: each of N connections sends
its next request when the previous one is answered.

Sizes: `small` is one short sentence per request (~17 tokens); `mixed` draws each text's
length in tokens from a bounded Pareto distribution (alpha 1.2, 8 to 512 tokens: most texts
short, a few very long), as a heavy-tailed mix of real traffic would.

Every request's latency and status is recorded. The client runs on uvloop with the raw
protocol in bench/http1.py, and reports its own CPU time (`client_cpu_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Generic, TypeVar
from urllib.parse import urlsplit

from bench.http1 import Http1Connection, build_request

SMALL_TEXT = "Sentence number {i} about pulling work from a shared queue."
_WORDS = [
    "queue",
    "worker",
    "batch",
    "pull",
    "push",
    "router",
    "gateway",
    "token",
    "model",
    "vector",
    "stream",
    "latency",
    "throughput",
    "accelerator",
    "request",
    "reply",
    "subject",
    "consumer",
    "deadline",
    "budget",
]
POOL_SIZE = 4096  # distinct prebuilt requests, cycled

Reading = TypeVar("Reading")


@dataclass
class LoadSpec:
    """What load to offer, and how."""

    url: str
    model: str
    mode: str = "closed"  # "open" or "closed"
    rate: float = 100.0  # open loop: mean arrivals per second
    connections: int = 64  # closed loop: concurrent clients; open loop: connections opened first
    max_connections: int = 4096  # open loop: at most this many requests in flight
    seconds: float = 10.0
    sizes: str = "small"  # "small" or "mixed"
    path: str = "/v1/embeddings"
    drain_s: float = 30.0  # how long to wait for answers after the last arrival
    seed: int = 1
    # Called (cheap, on the load's event loop) when the measured window starts: in the open
    # loop once its first connections are open; the closed loop opens its own in the window.
    on_window_start: Callable[[], None] | None = None


@dataclass
class LoadResult:
    """Summary of one load run, whichever client made it (this module, wrk, or httpx).

    `samples` holds (latency_s, status) of every request where the client records them.
    """

    mode: str  # "open" or "closed"
    sizes: str
    offered_rps: float  # open loop: the target rate; closed loop: 0
    connections: int
    seconds: float
    sent: int
    answered: int
    ok: int
    statuses: dict[str, int]
    rps: float  # answers per second of the measured window (200s where statuses are known)
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    client_cpu_s: float
    client_cores: float
    client: str = "loadgen"
    extra: dict[str, float] = field(default_factory=dict)
    samples: list[tuple[float, int]] = field(default_factory=list, repr=False)

    @property
    def requests(self) -> int:
        """Requests answered."""
        return self.answered

    @property
    def errors(self) -> int:
        """Requests sent that did not get a 200."""
        return self.sent - self.ok

    def summary(self) -> dict:
        """Everything but the per-request samples, with `requests` and `errors`."""
        fields = {k: v for k, v in asdict(self).items() if k != "samples"}
        return {**fields, "requests": self.requests, "errors": self.errors}


def request_bodies(model: str, sizes: str, count: int, seed: int) -> list[bytes]:
    """`count` distinct request bodies, one text each."""
    rng = random.Random(seed)
    bodies = []
    for i in range(count):
        if sizes == "small":
            text = SMALL_TEXT.format(i=i)
        elif sizes == "mixed":
            tokens = bounded_pareto(rng, alpha=1.2, low=8, high=512)
            words = [f"{rng.choice(_WORDS)}{i % 97}" for _ in range(max(1, round(tokens * 0.6)))]
            text = " ".join(words)
        else:
            raise ValueError(f"unknown sizes {sizes!r}: small or mixed")
        body = {"model": model, "input": text, "encoding_format": "base64"}
        bodies.append(json.dumps(body, separators=(",", ":")).encode())
    return bodies


def bounded_pareto(rng: random.Random, alpha: float, low: float, high: float) -> int:
    """A draw from the Pareto distribution truncated to [low, high] (inverse transform)."""
    u = rng.random()
    ratio = (low / high) ** alpha
    return round(low / (1 - u * (1 - ratio)) ** (1 / alpha))


class _Run:
    """The state of one load run: connections, pending arrivals, and every answer."""

    def __init__(self, spec: LoadSpec) -> None:
        parts = urlsplit(spec.url)
        self.spec = spec
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        netloc = parts.netloc
        self.requests = [
            build_request(netloc, spec.path, body)
            for body in request_bodies(spec.model, spec.sizes, POOL_SIZE, spec.seed)
        ]
        self.next_request = 0
        self.idle: deque[Http1Connection] = deque()
        self.opening = 0
        self.connections: list[Http1Connection] = []
        self.backlog: deque[float] = deque()  # open loop: arrival times waiting for a connection
        self.samples: list[tuple[float, int]] = []
        self.sent = 0
        self.in_flight = 0
        self.ok_in_window = 0
        self.window_end = 0.0
        self.sending = True
        self.done = asyncio.Event()
        self.loop = asyncio.get_running_loop()  # times come from time.perf_counter():
        # uvloop's loop.time() has millisecond resolution, too coarse for latencies.

    def on_response(self, conn: Http1Connection, status: int, body: bytes) -> None:
        now = time.perf_counter()
        self.samples.append((now - conn.tag, status))  # type: ignore[operator]
        self.in_flight -= 1
        if status == 200 and now <= self.window_end:
            self.ok_in_window += 1
        if status == 0:  # the connection broke: replace it
            if conn in self.connections:
                self.connections.remove(conn)
            self.loop.create_task(self._add_connection())
        elif self.spec.mode == "closed":
            if self.sending:
                self.send(conn, now)
        elif self.backlog:
            self.send(conn, self.backlog.popleft())
        else:
            self.idle.append(conn)
        if not self.sending and self.in_flight == 0 and not self.backlog:
            self.done.set()

    def send(self, conn: Http1Connection, arrival: float) -> None:
        conn.tag = arrival
        self.in_flight += 1
        self.sent += 1
        raw = self.requests[self.next_request]
        self.next_request = (self.next_request + 1) % len(self.requests)
        conn.send(raw)

    async def _add_connection(self) -> None:
        self.opening += 1
        try:
            conn = await Http1Connection.open(self.host, self.port, self.on_response)
        except OSError:
            return
        finally:
            self.opening -= 1
        self.connections.append(conn)
        if self.spec.mode == "closed":
            if self.sending:
                self.send(conn, time.perf_counter())
        elif self.backlog:
            self.send(conn, self.backlog.popleft())
        else:
            self.idle.append(conn)

    def arrive(self, at: float) -> None:
        # Last in, first out: hot connections are reused and cold ones may be closed by the
        # server's keep-alive timeout; a closed one is dropped here, never sent on.
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                self.send(conn, at)
                return
            self.connections.remove(conn)
        self.backlog.append(at)
        if len(self.connections) + self.opening < self.spec.max_connections:
            self.loop.create_task(self._add_connection())

    async def run(self) -> float:
        spec = self.spec
        first = spec.connections if spec.mode == "closed" else min(spec.connections, 1024)
        if spec.mode == "open":
            conns = await asyncio.gather(
                *(
                    Http1Connection.open(self.host, self.port, self.on_response)
                    for _ in range(first)
                )
            )
            self.connections.extend(conns)
            self.idle.extend(conns)
        started = time.perf_counter()
        self.window_end = started + spec.seconds
        if spec.on_window_start is not None:
            spec.on_window_start()
        if spec.mode == "closed":
            await asyncio.gather(*(self._add_connection() for _ in range(first)))
            await asyncio.sleep(spec.seconds)
        else:
            await self._arrivals(started)
        self.sending = False
        if self.in_flight == 0 and not self.backlog:
            self.done.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.done.wait(), spec.drain_s)
        unanswered = self.in_flight + len(self.backlog)
        self.samples.extend([(spec.drain_s, 0)] * unanswered)
        for conn in self.connections:
            conn.close()
        return spec.seconds

    async def _arrivals(self, started: float) -> None:
        """Poisson arrivals: dispatch every arrival that is due, then sleep to the next."""
        rng = random.Random(self.spec.seed)
        rate = self.spec.rate
        next_at = started + rng.expovariate(rate)
        end = started + self.spec.seconds
        while next_at < end:
            now = time.perf_counter()
            while next_at <= now and next_at < end:
                self.arrive(next_at)
                next_at += rng.expovariate(rate)
            # Sleeping less than a millisecond costs more wakeups than it gains precision;
            # an arrival sent up to 1 ms late still has its latency counted from its due time.
            await asyncio.sleep(max(0.001, next_at - time.perf_counter()))


def run_load(spec: LoadSpec) -> LoadResult:
    """Offer the load described by `spec` (blocking) and summarize every answer."""
    import uvloop

    cpu_before = time.process_time()
    wall_before = time.monotonic()

    async def main() -> _Run:
        run = _Run(spec)
        await run.run()
        return run

    run = uvloop.run(main())
    cpu = time.process_time() - cpu_before
    wall = time.monotonic() - wall_before
    latencies = sorted(latency for latency, _ in run.samples)
    statuses = Counter(str(status) for _, status in run.samples)
    answered = sum(1 for _, status in run.samples if status != 0)
    return LoadResult(
        mode=spec.mode,
        sizes=spec.sizes,
        offered_rps=spec.rate if spec.mode == "open" else 0.0,
        connections=spec.connections if spec.mode == "closed" else len(run.connections),
        seconds=spec.seconds,
        sent=run.sent + len(run.backlog),
        answered=answered,
        ok=statuses.get("200", 0),
        statuses=dict(statuses),
        # Closed loop: answers within the window. Open loop: every arrival was in the window,
        # so every answer counts, including those that came during the drain.
        rps=(run.ok_in_window if spec.mode == "closed" else statuses.get("200", 0)) / spec.seconds,
        p50_ms=1000 * quantile(latencies, 0.50),
        p90_ms=1000 * quantile(latencies, 0.90),
        p99_ms=1000 * quantile(latencies, 0.99),
        max_ms=1000 * (latencies[-1] if latencies else 0.0),
        mean_ms=1000 * (sum(latencies) / len(latencies) if latencies else 0.0),
        client_cpu_s=cpu,
        client_cores=cpu / wall if wall > 0 else 0.0,
        # Open loop: fewer answers inside the window than arrivals (beyond those still in
        # flight at its end) is a queue that grew: a rate over what the server keeps up with.
        extra={"ok_in_window": float(run.ok_in_window)},
        samples=run.samples,
    )


@dataclass
class WindowReadings(Generic[Reading]):
    """What a reader returned at the start of a load's measured window and `seconds` later."""

    before: Reading
    after: Reading
    seconds: float


def run_load_in_window(
    spec: LoadSpec, read: Callable[[], Reading]
) -> tuple[LoadResult, WindowReadings[Reading]]:
    """`run_load`, with `read()` called from a thread when the measured window starts and
    again when it ends, so that what is read (CPU, the workers' counters) covers the window
    alone: not the open loop's opening of connections, nor the wait for the last answers. (The
    whole call once served as the window: one late answer, a redelivery after the 10 s
    ack_wait, stretched 5 s calls to 15 s and read busy at a third of the truth.) The
    window's own last answers come after it, so work over answers reads a few per cent low.
    """
    started = threading.Event()
    readings: list[tuple[float, Reading]] = []
    failures: list[Exception] = []  # a reading that failed is raised here, not lost in the thread

    def read_at_both_ends() -> None:
        if not started.wait(timeout=600):
            return
        try:
            began = time.monotonic()
            readings.append((began, read()))
            time.sleep(max(0.0, spec.seconds - (time.monotonic() - began)))
            readings.append((time.monotonic(), read()))
        except Exception as error:
            failures.append(error)

    reader = threading.Thread(target=read_at_both_ends, daemon=True)
    reader.start()
    result = run_load(replace(spec, on_window_start=started.set))
    reader.join()
    if failures:
        raise failures[0]
    if len(readings) < 2:
        raise RuntimeError("the load's window never started: nothing was read")
    (began, before), (ended, after) = readings
    return result, WindowReadings(before, after, ended - began)


def quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=("open", "closed"), default="closed")
    parser.add_argument("--rate", type=float, default=100.0, help="open loop: requests/s")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--sizes", choices=("small", "mixed"), default="small")
    parser.add_argument("--dump", default=None, help="write every (latency_s, status) here")
    args = parser.parse_args()
    spec = LoadSpec(
        url=args.url,
        model=args.model,
        mode=args.mode,
        rate=args.rate,
        connections=args.connections,
        seconds=args.seconds,
        sizes=args.sizes,
    )
    result = run_load(spec)
    print(json.dumps(result.summary(), indent=2))
    if args.dump:
        with open(args.dump, "w") as handle:
            json.dump(result.samples, handle)


if __name__ == "__main__":
    main()
