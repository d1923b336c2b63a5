"""Soak: a steady open-loop load at a fraction of saturation for many minutes; is anything growing?

    python -m bench.soak [--minutes 10] [--load 0.8] [--saturation open|closed]
        [--model all-MiniLM-L6-v2] [--window-s 60] [--warmup-windows N] [--saturation-s 20]
        [--saturation-windows 3] [--saturation-warmup-s 20] [--capacity-s 20]
        [--capacity-steps 5] [--nats-diag 30] [--out soak]

One `shoal up` (embedded nats-server, one gateway, one worker) serving `--model`. First the
cluster's closed-loop rate: 64 connections for `--saturation-warmup-s` (discarded: the first
seconds after start run on cold caches and a worker still settling its batch budget), then
`--saturation-windows` windows of `--saturation-s` each, whose median is taken (one short
window read 25% high once).

Saturation is then measured the way the soak loads the cluster (`--saturation open`, the
default): the highest rate of Poisson arrivals it keeps up with, by bisection (`--capacity-steps`
windows of `--capacity-s`) between half the closed-loop rate and all of it. A rate is kept up
with when at least `SUSTAINED_SHARE` of a window's arrivals are answered inside the window (a
queue that grows leaves more than that unanswered at its end). Why not the closed-loop rate:
64 connections keep 64 requests waiting, so the worker always runs full batches; random
arrivals leave it smaller ones that cost more per item on a CPU model (the default model here:
~9 ms a batch besides ~1.75 ms an item, measured in service; docs/benchmarks.md), and the
open-loop client costs the two cores more. At 0.8 of the
closed-loop rate the worker was 95-99% busy, and every burst built a queue that took seconds
to drain: a soak of a saturated cluster, not of one at 80%. `--saturation closed` uses the
closed-loop rate (the old definition). Every window reports the worker's busy fraction and mean
batch (`shoal_worker_busy_seconds`, `shoal_worker_batch_items`), so the headroom is shown.

The load runs in back-to-back windows of `--window-s`, for `--minutes`. Each window reports
its p50/p99, errors (anything but a 200) and lost requests (sent but never answered); the
resident memory (RSS) of every process `shoal up` started is sampled every few seconds, by
component (gateway, worker, nats, supervisor), and beside it its anonymous part (RssAnon: what
the process holds, without the file-backed pages of its executable; reported, not judged).

Growth is judged after warm-up (`--warmup-windows` windows; default two minutes' worth, or
four of the work stream's duplicate windows if that is longer, by when nats-server's message
ids have reached their steady size; see `WARMUP_S`): the least-squares line through each
component's RSS samples after warm-up, its rise from the first sample to the last as a share
of the mean (`--max-growth`, 10% by default). A trend, because RSS saw-tooths: nats-server's
rose and fell by 5-8 MB every ~6 minutes in a 30-minute run (its GC and the Go runtime
handing pages back), so a rule that compared the median of the first window after warm-up
with the last window's (the rule until this one, still reported beside it) judged the phase
of the saw-tooth: a trough against a peak read +17% in a run whose level did not move. The
peak after warm-up is reported too. The run's verdict lists every component over that bound, every
window with errors or lost requests, a p99 that drifts (the last three windows' median over 2x
the first window's after warm-up) and any window after warm-up whose p99 is over 2x the median
of those windows (a spike).

`--nats-diag S` also samples the embedded nats-server's heap profile, streams and store every
S seconds (`bench/nats_diag.py`) into the result's `nats_diagnostics` (and, with
`--nats-diag-dir`, keeps each raw profile). `bench/memprobe/` (on `PYTHONPATH`, with
`SHOAL_MEMPROBE_DIR`) samples the Python components' allocator and batch sizes.
"""

from __future__ import annotations

import argparse
import math
import statistics
import threading
import time
from pathlib import Path

from bench.fleet_metrics import WindowFigures, scrape, window
from bench.harness import UpCluster, component_tree, machine_facts, write_result
from bench.loadgen import LoadResult, LoadSpec, run_load, run_load_in_window
from bench.nats_diag import NatsDiagnostics
from shoal.config import QueueSettings

RSS_SAMPLE_S = 5.0
# nats-server keeps the id of every work message for the stream's duplicate window
# (QueueSettings.duplicate_window_s), and the expired ones until its list of ids is compacted,
# once the list holds about three times what the window does: its heap, and the GC's target
# with it, reach their steady size after about four windows (bench/nats_diag.py showed it).
# Two minutes at least, for everything else (the worker's allocator, the gateway's buffers).
WARMUP_S = 120.0
DEDUP_WINDOWS_TO_STEADY = 4
P99_DRIFT_BOUND = 2.0
# A window after warm-up whose p99 is over this multiple of those windows' median is a spike:
# a minute in which the queue built up, which a steady 80% load should not see.
P99_SPIKE_BOUND = 2.0
# Answers inside an open-loop window over its arrivals, at least: below it the queue grew. A
# rate that is kept up with leaves out only what is in flight at the window's end (latency x
# rate: 0.5% for 100 ms in 20 s); 2% above capacity for 20 s leaves out 2% and more.
SUSTAINED_SHARE = 0.98
# The anonymous part of a component's RSS is sampled beside it under this suffix. It is not
# judged (the bound is on RSS): it tells growth of memory the process holds from code pages of
# its executable being mapped in (nats-server's binary is ~19 MB, file-backed).
ANON = " anon"


def warmup_s() -> float:
    """How long before RSS is judged: `WARMUP_S`, or four duplicate windows if longer."""
    window = QueueSettings.from_environment().duplicate_window_s
    return max(WARMUP_S, DEDUP_WINDOWS_TO_STEADY * window)


def rss_mb(pid: int) -> tuple[float, float]:
    """A process's resident memory in MB, all of it and its anonymous part (heap, stacks: not
    the pages of its executable and libraries, which are file-backed and shared); 0 once it
    is gone."""
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon"):
                fields[name] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return fields.get("VmRSS", 0.0), fields.get("RssAnon", 0.0)


def component_rss(up: UpCluster) -> dict[str, float]:
    """RSS in MB of each component of a running `shoal up`, its processes added up, and
    beside each its anonymous part (`<component> anon`: reported, not judged)."""
    assert up.process is not None
    totals: dict[str, float] = {}
    for pid, name in component_tree(up.process.pid).items():
        rss, anon = rss_mb(pid)
        totals[name] = totals.get(name, 0.0) + rss
        totals[name + ANON] = totals.get(name + ANON, 0.0) + anon
    return totals


class RssSampler(threading.Thread):
    """Samples `component_rss` every `interval_s` until stopped."""

    def __init__(self, up: UpCluster, interval_s: float) -> None:
        super().__init__(daemon=True)
        self._up = up
        self._interval_s = interval_s
        self._halt = threading.Event()
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._t0 = time.monotonic()

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.monotonic() - self._t0, component_rss(self._up)))
            self._halt.wait(self._interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.samples.append((time.monotonic() - self._t0, component_rss(self._up)))

    def at(self, elapsed_s: float) -> dict[str, float]:
        """The last sample taken at or before `elapsed_s`."""
        chosen = self.samples[0][1]
        for when, rss in self.samples:
            if when > elapsed_s:
                break
            chosen = rss
        return chosen


def closed_loop_rps(url: str, model: str, seconds: float) -> float:
    """Requests answered per second by a closed loop of 64 connections."""
    result = run_load(
        LoadSpec(url=url, model=model, mode="closed", connections=64, seconds=seconds)
    )
    return result.rps


def closed_loop_median(
    url: str, model: str, warmup_s: float, seconds: float, windows: int
) -> tuple[float, list[float]]:
    """The median closed-loop rate over `windows` windows of `seconds`, after `warmup_s` of
    the same load (discarded); and each window's rate."""
    if warmup_s > 0:
        warm = closed_loop_rps(url, model, warmup_s)
        print(f"closed-loop warm-up ({warmup_s:g} s): {warm:.0f} req/s (discarded)")
    rates = []
    for index in range(windows):
        rates.append(closed_loop_rps(url, model, seconds))
        print(f"closed-loop window {index + 1}/{windows} ({seconds:g} s): {rates[-1]:.0f} req/s")
    return statistics.median(rates), rates


def measured_window(urls: list[str], spec: LoadSpec) -> tuple[LoadResult, WindowFigures]:
    """One load run and what the workers did during its window."""
    result, readings = run_load_in_window(spec, lambda: scrape(urls))
    return result, window(readings.before, readings.after, readings.seconds)


def open_loop_capacity(
    up: UpCluster, urls: list[str], model: str, closed_rps: float, seconds: float, steps: int
) -> tuple[float, list[dict]]:
    """The highest Poisson rate the cluster keeps up with, by bisection between half the
    closed-loop rate and all of it (the lower bound, if no probe kept up); and each probe."""
    low, high, probes = 0.5 * closed_rps, closed_rps, []
    for index in range(steps):
        rate = (low + high) / 2
        spec = LoadSpec(
            url=up.url, model=model, mode="open", rate=rate, seconds=seconds, seed=1000 + index
        )
        result, device = measured_window(urls, spec)
        share = result.extra["ok_in_window"] / max(1, result.sent)
        kept_up = share >= SUSTAINED_SHARE
        probes.append(
            {
                "offered_rps": rate,
                "answered_in_window": share,
                "kept_up": kept_up,
                "p99_ms": result.p99_ms,
                "busy": device.busy_mean,
                "mean_batch": device.mean_batch,
            }
        )
        print(
            f"capacity probe {index + 1}/{steps}: {rate:.0f} req/s offered, {100 * share:.1f}% "
            f"answered in the window ({'kept up' if kept_up else 'fell behind'}), busy "
            f"{device.busy_mean:.2f}, batch {device.mean_batch:.1f}, p99 {result.p99_ms:.0f} ms"
        )
        low, high = (rate, high) if kept_up else (low, rate)
    return low, probes


def soak(args: argparse.Namespace) -> dict:
    windows = max(1, round(args.minutes * 60 / args.window_s))
    diagnostics = None
    if args.nats_diag > 0:
        profile_dir = Path(args.nats_diag_dir) if args.nats_diag_dir else None
        diagnostics = NatsDiagnostics(args.nats_diag, profile_dir)
        print(
            f"nats-server monitoring on 127.0.0.1:{diagnostics.monitor_port}, "
            f"profiling on 127.0.0.1:{diagnostics.profile_port}"
        )
    env = diagnostics.environment if diagnostics else None
    with UpCluster("--model", args.model, env=env) as up:
        run_load(LoadSpec(url=up.url, model=args.model, mode="closed", seconds=3))  # warm
        closed_loop, saturation_windows = closed_loop_median(
            up.url, args.model, args.saturation_warmup_s, args.saturation_s, args.saturation_windows
        )
        urls = up.reported_metrics_urls()
        capacity, probes = closed_loop, []
        if args.saturation == "open":
            capacity, probes = open_loop_capacity(
                up, urls, args.model, closed_loop, args.capacity_s, args.capacity_steps
            )
        rate = args.load * capacity
        print(
            f"closed loop {closed_loop:.0f} req/s (median of {len(saturation_windows)}), "
            f"saturation ({args.saturation} loop) {capacity:.0f} req/s; offering {rate:.0f} "
            f"req/s ({args.load:g} of saturation, {rate / closed_loop:.2f} of the closed loop)"
        )
        sampler = RssSampler(up, min(RSS_SAMPLE_S, args.window_s / 2))
        sampler.start()
        if diagnostics:
            diagnostics.begin(Path(up.state_dir) / "nats")
        started = time.monotonic()
        results = []
        devices: list[WindowFigures] = []
        ends: list[float] = []
        for index in range(windows):
            spec = LoadSpec(
                url=up.url,
                model=args.model,
                mode="open",
                rate=rate,
                seconds=args.window_s,
                seed=index + 1,
            )
            result, device = measured_window(urls, spec)
            ends.append(time.monotonic() - started)
            results.append(result)
            devices.append(device)
            lost = result.sent - result.answered
            print(
                f"window {index + 1:>3}/{windows}: {result.rps:7.1f} req/s, p50 "
                f"{result.p50_ms:7.1f} ms, p99 {result.p99_ms:7.1f} ms, busy "
                f"{device.busy_mean:.2f}, batch {device.mean_batch:5.1f}, errors {result.errors}, "
                f"lost {lost}, rss {_rss_line(sampler.at(ends[-1]))}"
            )
        sampler.stop()
        if diagnostics:
            diagnostics.stop()
            print("\n".join(diagnostics.summary_lines()))
    summary = _verdict(args, capacity, rate, results, ends, sampler)
    summary["closed_loop_rps"] = closed_loop
    summary["saturation_windows_rps"] = saturation_windows
    summary["capacity_probes"] = probes
    for record, device in zip(summary["windows"], devices, strict=True):
        record["busy"] = device.busy_mean
        record["mean_batch"] = device.mean_batch
    if diagnostics:
        summary["nats_diagnostics"] = {
            "interval_s": diagnostics.interval_s,
            "samples": diagnostics.samples,
            "errors": diagnostics.errors,
        }
    return summary


def _rss_line(rss: dict[str, float]) -> str:
    return ", ".join(
        f"{name} {mb:.0f} MB ({rss.get(name + ANON, 0.0):.0f} anon)"
        for name, mb in sorted(rss.items())
        if not name.endswith(ANON)
    )


def _verdict(
    args: argparse.Namespace,
    saturation: float,
    rate: float,
    results: list,
    ends: list[float],
    sampler: RssSampler,
) -> dict:
    warmup = args.warmup_windows
    if warmup is None:
        warmup = max(1, math.ceil(warmup_s() / args.window_s))
    # At least one window after warm-up is judged, even in a run too short to warm up.
    warmup = max(0, min(warmup, len(ends) - 1))
    first = _window_samples(sampler, ends, warmup)
    last = _window_samples(sampler, ends, len(ends) - 1)
    start = ends[warmup - 1] if warmup else 0.0  # the end of the warm-up
    judged = [rss for when, rss in sampler.samples if when > start]
    names = sorted({name for _, rss in sampler.samples for name in rss})
    after_warmup = {name: statistics.median(r.get(name, 0.0) for r in first) for name in names}
    final = {name: statistics.median(r.get(name, 0.0) for r in last) for name in names}
    peak = {name: max(r.get(name, 0.0) for r in judged) for name in names}
    growth = {name: (final[name] - mb) / mb for name, mb in after_warmup.items() if mb > 0}
    trend = {name: trend_growth(sampler.samples, name, start) for name in names}
    p99s = [result.p99_ms for result in results]
    baseline = p99s[warmup]  # the first window after warm-up
    tail = p99s[-3:]
    steady = statistics.median(p99s[warmup:])
    failures = []
    for name, rise in sorted(trend.items()):
        if rise > args.max_growth and not name.endswith(ANON):
            failures.append(f"{name} RSS grew {100 * rise:.1f}% after warm-up (trend)")
    for index, result in enumerate(results, 1):
        if result.errors or result.sent != result.answered:
            failures.append(
                f"window {index}: {result.errors} errors, {result.sent - result.answered} lost"
            )
    if statistics.median(tail) > P99_DRIFT_BOUND * baseline:
        failures.append(f"p99 drifted: {baseline:.1f} ms -> {tail} ms")
    for index, p99 in enumerate(p99s[warmup:], warmup + 1):
        if p99 > P99_SPIKE_BOUND * steady:
            failures.append(f"window {index}: p99 {p99:.0f} ms, over 2x the median {steady:.0f}")
    summary = {
        "machine": machine_facts(),
        "model": args.model,
        "minutes": args.minutes,
        "load": args.load,
        "saturation": args.saturation,
        "saturation_rps": saturation,
        "warmup_windows": warmup,
        "offered_rps": rate,
        "windows": [
            {
                "end_s": end,
                "rps": r.rps,
                "p50_ms": r.p50_ms,
                "p99_ms": r.p99_ms,
                "errors": r.errors,
                "lost": r.sent - r.answered,
            }
            for r, end in zip(results, ends, strict=True)
        ],
        "rss_rule": "least-squares trend of the samples after warm-up, over their span",
        "rss_trend_growth": trend,
        "rss_window_rule": "median of the first window after warm-up -> median of the last",
        "rss_after_warmup_mb": after_warmup,
        "rss_final_mb": final,
        "rss_peak_after_warmup_mb": peak,
        "p99_median_after_warmup_ms": steady,
        "rss_growth": growth,
        "rss_samples": sampler.samples,
        "errors": sum(r.errors for r in results),
        "lost": sum(r.sent - r.answered for r in results),
        "failures": failures,
        "passed": not failures,
    }
    print(
        "RSS after warm-up: trend over the run (judged); median of the first window -> the "
        "last (reported); peak: "
        + ", ".join(
            f"{name} {100 * trend[name]:+.1f}%; {after_warmup[name]:.1f} -> {final[name]:.1f} MB "
            f"({100 * growth.get(name, 0):+.1f}%), peak {peak[name]:.1f}"
            for name in names
        )
    )
    print("PASSED" if not failures else "FAILED:\n  " + "\n  ".join(failures))
    return summary


def trend_growth(samples: list[tuple[float, dict[str, float]]], name: str, after_s: float) -> float:
    """How much `name`'s RSS grew after `after_s`, as a share of its mean: the least-squares
    line through its samples, from the first to the last (0 with fewer than two)."""
    points = [(when, rss[name]) for when, rss in samples if when > after_s and name in rss]
    if len(points) < 2:
        return 0.0
    times, values = zip(*points, strict=True)
    mean = statistics.fmean(values)
    if mean <= 0 or times[-1] == times[0]:
        return 0.0
    slope, _ = statistics.linear_regression(times, values)
    return slope * (times[-1] - times[0]) / mean


def _window_samples(sampler: RssSampler, ends: list[float], index: int) -> list[dict[str, float]]:
    """The RSS samples taken during window `index` (0-based), or the one nearest its end."""
    start = ends[index - 1] if index else 0.0
    inside = [rss for when, rss in sampler.samples if start < when <= ends[index]]
    return inside or [sampler.at(ends[index])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of saturation")
    parser.add_argument(
        "--saturation",
        choices=("open", "closed"),
        default="open",
        help="saturation: the Poisson rate kept up with, or the closed loop's rate",
    )
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument(
        "--warmup-windows", type=int, default=None, help="windows before RSS is compared"
    )
    parser.add_argument("--saturation-s", type=float, default=20.0, help="one closed-loop window")
    parser.add_argument(
        "--saturation-windows",
        type=int,
        default=3,
        help="closed-loop windows; their median is used",
    )
    parser.add_argument(
        "--saturation-warmup-s", type=float, default=20.0, help="closed loop before the probe"
    )
    parser.add_argument(
        "--capacity-s", type=float, default=20.0, help="one open-loop capacity probe"
    )
    parser.add_argument("--capacity-steps", type=int, default=5, help="bisection steps")
    parser.add_argument("--max-growth", type=float, default=0.10, help="RSS growth allowed")
    parser.add_argument(
        "--nats-diag", type=float, default=0.0, help="sample nats-server's heap every S s (0: off)"
    )
    parser.add_argument("--nats-diag-dir", help="keep each raw heap profile in this folder")
    parser.add_argument("--out", default="soak", help="result name or path")
    args = parser.parse_args()
    summary = soak(args)
    print(f"wrote {write_result(args.out, summary)}")
    raise SystemExit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
