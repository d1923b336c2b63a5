"""What an embedded nats-server holds, sampled while a benchmark runs: why does its RSS grow?

`NatsDiagnostics` picks the two diagnostic ports (`SHOAL_NATS_MONITOR_PORT`,
`SHOAL_NATS_PROFILE_PORT`, read by `shoal.broker.embedded`), to be passed in `shoal up`'s
environment; its sampler then reads, every `interval_s`:

- `/varz`: the server's own RSS (`mem`) and JetStream's memory and file use;
- `/jsz`: every stream's state (messages, bytes, first/last sequence, deleted-but-not-compacted
  messages), the KV buckets and the object store included (they are streams);
- `/debug/pprof/heap?debug=1`: Go's `runtime.MemStats` (heap in use, idle, released to the
  OS, next GC target) and the live heap by allocation site (sampled by Go one allocation per
  `PROFILE_RATE` bytes, `GODEBUG=memprofilerate`, and scaled back here);
- the store directory: each stream's block files and their bytes on disk.

So RSS can be split into what the Go heap holds live, what the GC has freed but not yet handed
back, and everything else, and live heap growth can be pinned to the code that allocated it.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import time
import urllib.request
from pathlib import Path

from shoal.process import free_ports

# The MemStats lines the sample keeps (bytes, except NumGC).
MEMSTATS = (
    "HeapAlloc",
    "HeapInuse",
    "HeapIdle",
    "HeapReleased",
    "HeapSys",
    "Sys",
    "NextGC",
    "NumGC",
    "NumForcedGC",
    "Stack",
    "GCSys",
    "OtherSys",
)
# Allocation sites kept per sample, by live bytes.
TOP_SITES = 12
_RECORD = re.compile(r"^(\d+): (\d+) \[(\d+): (\d+)\] @")
# The profile's first line: every sampled allocation, live and since the start, scaled.
_HEADER = re.compile(r"^heap profile: (\d+): (\d+) \[(\d+): (\d+)\] @ heap/(\d+)")
_FRAME = re.compile(r"^#\s+0x[0-9a-f]+\s+(\S+)")
# Go samples one allocation per this many bytes on average; the diagnostic run asks for a finer
# rate than the default 512 KiB, at which a few dozen small objects stand for the whole heap.
PROFILE_RATE = 4096


def parse_heap_profile(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """Go's text heap profile -> (MemStats fields, live bytes by allocation site).

    The MemStats also get the profile's totals: `ProfileInuse` (live bytes at the last GC, by
    the profile) and `ProfileAlloc` (bytes allocated since the start). A site is the innermost
    nats-server function of the allocating stack (the runtime's and the standard library's
    frames say little about which of the server's structures grows).
    """
    stats: dict[str, int] = {}
    sites: dict[str, int] = {}
    live = 0.0
    site = ""
    rate = 512 * 1024
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            rate = int(header[5]) // 2  # the header says heap/<2 x MemProfileRate>
            stats["ProfileInuse"] = round(_scaled(int(header[1]), int(header[2]), rate))
            stats["ProfileAlloc"] = round(_scaled(int(header[3]), int(header[4]), rate))
            continue
        record = _RECORD.match(line)
        if record:
            _flush(sites, site, live)
            live, site = _scaled(int(record[1]), int(record[2]), rate), ""
            continue
        frame = _FRAME.match(line)
        if frame:
            name = frame.group(1)
            if not site or ("nats-server" in name and "nats-server" not in site):
                site = name
            continue
        if line.startswith("# ") and " = " in line:
            key, _, value = line[2:].partition(" = ")
            if key in MEMSTATS:
                stats[key] = int(value.split()[0])
    _flush(sites, site, live)
    return stats, sites


def _scaled(count: int, size: int, rate: int) -> float:
    """Bytes a sample of `count` objects of `size` bytes in all stands for: the text profile
    gives raw samples, and an object of s bytes is sampled with probability 1 - exp(-s / rate)
    (what pprof's scaleHeapSample undoes)."""
    if count == 0 or size == 0 or rate <= 1:
        return float(size)
    average = size / count
    return size / (1 - math.exp(-average / rate))


def _flush(sites: dict[str, int], site: str, live: float) -> None:
    if site and live:
        sites[_short(site)] = sites.get(_short(site), 0) + round(live)


def _short(function: str) -> str:
    # github.com/nats-io/nats-server/v2/server.(*fileStore).x -> server.(*fileStore).x
    return function.rpartition("/")[2]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def stream_states(jsz: dict) -> dict[str, dict[str, int]]:
    """Each stream's state from `/jsz?accounts=true&streams=true`."""
    streams: dict[str, dict[str, int]] = {}
    for account in jsz.get("account_details") or []:
        for stream in account.get("stream_detail") or []:
            state = stream.get("state") or {}
            streams[stream["name"]] = {
                key: int(state.get(key) or 0)
                for key in ("messages", "bytes", "first_seq", "last_seq", "num_deleted")
            }
    return streams


def store_files(store_dir: Path) -> dict[str, dict[str, int]]:
    """Each stream's message block files in a JetStream store: how many, and their bytes."""
    streams: dict[str, dict[str, int]] = {}
    for block in store_dir.glob("jetstream/*/streams/*/msgs/*.blk"):
        entry = streams.setdefault(block.parent.parent.name, {"blocks": 0, "bytes": 0})
        entry["blocks"] += 1
        with contextlib.suppress(OSError):  # removed between the listing and the stat
            entry["bytes"] += block.stat().st_size
    return streams


class NatsDiagnostics(threading.Thread):
    """Samples an embedded nats-server's memory, streams and heap every `interval_s`."""

    def __init__(self, interval_s: float = 30.0, profile_dir: Path | None = None) -> None:
        super().__init__(daemon=True)
        self.profile_dir = profile_dir  # where each raw heap profile is kept, if anywhere
        self.monitor_port, self.profile_port = free_ports(2)
        self.interval_s = interval_s
        self.store_dir: Path | None = None
        self.samples: list[dict] = []
        self.errors: list[str] = []
        self._halt = threading.Event()
        self._t0 = time.monotonic()

    @property
    def environment(self) -> dict[str, str]:
        """What `shoal up` needs in its environment to open the two ports."""
        return {
            "SHOAL_NATS_MONITOR_PORT": str(self.monitor_port),
            "SHOAL_NATS_PROFILE_PORT": str(self.profile_port),
            # Only nats-server is a Go program here; Python ignores it.
            "GODEBUG": f"memprofilerate={PROFILE_RATE}",
        }

    def begin(self, store_dir: Path) -> None:
        """Start sampling a server whose JetStream store is `store_dir`."""
        self.store_dir = store_dir
        self._t0 = time.monotonic()
        self.start()

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.sample()

    def sample(self) -> None:
        """One sample; a failed read is recorded, not raised (the soak goes on)."""
        monitor = f"http://127.0.0.1:{self.monitor_port}"
        try:
            varz = json.loads(_get(f"{monitor}/varz"))
            jsz = json.loads(_get(f"{monitor}/jsz?accounts=true&streams=true"))
            heap = _get(f"http://127.0.0.1:{self.profile_port}/debug/pprof/heap?debug=1", 20)
        except (OSError, ValueError) as err:
            self.errors.append(f"{time.monotonic() - self._t0:.0f} s: {err}")
            return
        elapsed = time.monotonic() - self._t0
        if self.profile_dir is not None:
            self.profile_dir.mkdir(parents=True, exist_ok=True)
            (self.profile_dir / f"heap-{elapsed:04.0f}s.txt").write_bytes(heap)
        stats, sites = parse_heap_profile(heap.decode(errors="replace"))
        top = dict(sorted(sites.items(), key=lambda item: -item[1])[:TOP_SITES])
        js_stats = (varz.get("jetstream") or {}).get("stats") or {}
        self.samples.append(
            {
                "t_s": round(elapsed, 1),
                "rss_mb": varz.get("mem", 0) / 2**20,
                "jetstream_memory": js_stats.get("memory", 0),
                "jetstream_storage": js_stats.get("storage", 0),
                "memstats": stats,
                "heap_sites": top,
                "streams": stream_states(jsz),
                "store_files": store_files(self.store_dir) if self.store_dir else {},
            }
        )

    def summary_lines(self) -> list[str]:
        """The first and last sample side by side: RSS, heap, and what grew most."""
        if len(self.samples) < 2:
            return ["nats diagnostics: fewer than two samples"]
        first, last = self.samples[0], self.samples[-1]
        mb = 2**20
        lines = [
            f"nats-server {first['t_s']:.0f} s -> {last['t_s']:.0f} s: RSS "
            f"{first['rss_mb']:.1f} -> {last['rss_mb']:.1f} MB; "
            + ", ".join(
                f"{key} {first['memstats'].get(key, 0) / mb:.1f} -> "
                f"{last['memstats'].get(key, 0) / mb:.1f} MB"
                for key in ("ProfileInuse", "HeapAlloc", "HeapInuse", "HeapReleased", "NextGC")
            )
        ]
        for site, live in last["heap_sites"].items():
            before = first["heap_sites"].get(site, 0)
            lines.append(f"  {site}: {before / mb:.1f} -> {live / mb:.1f} MB live")
        for name, state in last["streams"].items():
            lines.append(f"  stream {name}: {state}")
        return lines
