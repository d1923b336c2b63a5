"""Tables (Markdown) and plots (PNG) from bench.push_vs_pull results.

    python -m bench.report_push_vs_pull [bench/results/push_vs_pull_sim.json ...]
        [--plots docs/img] [--focus 16]

For each results file: a saturation table (every worker count and system), a constant-load
table for every worker count, and three plots: throughput vs workers, busy fraction vs offered
load, p99 latency vs offered load (one panel per worker count). Needs matplotlib (`bench`
extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.harness import RESULTS_DIR

ORDER = ("shoal", "shoal-eager", "rr", "lor", "p2c", "ray", "infinity")
PUSH = ("rr", "lor", "p2c")
LABELS = {
    "shoal": "Shoal (pull)",
    "shoal-eager": "Shoal, batch wait off",
    "rr": "push: round robin",
    "lor": "push: least outstanding",
    "p2c": "push: power of two",
    "ray": "Ray Serve",
    "infinity": "Infinity",
}


def systems_of(entry: dict) -> list[str]:
    """The systems measured for one worker count (a peer that failed has only `error`)."""
    return [s for s in ORDER if s in entry and "saturation" in entry[s]]


def saturation_table(data: dict) -> str:
    lines = [
        "| workers | system | req/s at saturation | vs Shoal | mean batch | busy mean / min "
        "| p50 / p99 ms | client cores |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workers, entry in sorted(data["by_workers"].items(), key=lambda kv: int(kv[0])):
        shoal = entry.get("shoal", {}).get("saturation", {}).get("load", {}).get("rps")
        for name in systems_of(entry):
            sat = entry[name]["saturation"]
            load, figs = sat["load"], sat["workers"]
            ratio = f"{load['rps'] / shoal:.2f}" if shoal else "-"
            busy = f"{figs['busy_mean']:.2f} / {figs['busy_min']:.2f}" if figs else "n/a"
            batch = f"{figs['mean_batch']:.1f}" if figs else "n/a"
            lines.append(
                f"| {workers} | {LABELS[name]} | {load['rps']:,.0f} | {ratio} | {batch} | {busy} "
                f"| {load['p50_ms']:.0f} / {load['p99_ms']:.0f} | {load['client_cores']:.2f} |"
            )
    return "\n".join(lines)


def load_table(data: dict, workers: str) -> str:
    entry = data["by_workers"][workers]
    lines = [
        "| offered (share of Shoal's saturation) | system | answered req/s | busy mean / min "
        "| mean batch | p50 / p99 ms | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    fractions = sorted({f for name in systems_of(entry) for f in entry[name]["loads"]})
    for fraction in fractions:
        for name in systems_of(entry):
            measured = entry[name]["loads"].get(fraction)
            if measured is None:
                continue
            load, figs = measured["load"], measured["workers"]
            busy = f"{figs['busy_mean']:.2f} / {figs['busy_min']:.2f}" if figs else "n/a"
            batch = f"{figs['mean_batch']:.1f}" if figs else "n/a"
            lines.append(
                f"| {load['offered_rps']:,.0f}/s ({float(fraction):.0%}) | {LABELS[name]} "
                f"| {load['rps']:,.0f} | {busy} | {batch} "
                f"| {load['p50_ms']:.0f} / {load['p99_ms']:.0f} | {load['sent'] - load['ok']} |"
            )
    return "\n".join(lines)


def scaling_table(data: dict, system: str = "shoal") -> str:
    rows = sorted(data["by_workers"].items(), key=lambda kv: int(kv[0]))
    one = next((e[system]["saturation"]["load"]["rps"] for n, e in rows if n == "1"), None)
    if not one:
        return ""
    lines = [
        f"| workers | {LABELS[system]} req/s | N x one worker | efficiency | cores: "
        "gateway / nats / workers / client |",
        "|---|---|---|---|---|",
    ]
    for workers, entry in rows:
        if system not in systems_of(entry):
            continue
        sat = entry[system]["saturation"]
        rps, cores = sat["load"]["rps"], sat["cores"]
        ideal = int(workers) * one
        used = (
            " / ".join(f"{cores.get(k, 0):.2f}" for k in ("gateway", "nats", "worker"))
            + f" / {sat['load']['client_cores']:.2f}"
        )
        lines.append(f"| {workers} | {rps:,.0f} | {ideal:,.0f} | {rps / ideal:.2f} | {used} |")
    return "\n".join(lines)


def path_cpu_table(data: dict) -> str:
    """CPU microseconds a request, by component, at saturation: each system's own path (the
    load client excluded), from the processes' CPU time over the measured window."""
    lines = [
        "| workers | system | req/s | gateway or router us | nats-server us | workers us "
        "| path us |",
        "|---|---|---|---|---|---|---|",
    ]
    for workers, entry in sorted(data["by_workers"].items(), key=lambda kv: int(kv[0])):
        for name in systems_of(entry):
            sat = entry[name]["saturation"]
            cores, rps = sat.get("cores") or {}, sat["load"]["rps"]
            if not cores or not rps:
                continue
            front = cores.get("gateway", cores.get("router", 0.0))
            nats, worker = cores.get("nats"), cores.get("worker", 0.0)
            total = sum(v for k, v in cores.items() if k != "supervisor")
            per = 1e6 / rps
            nats_us = f"{nats * per:.0f}" if nats is not None else "-"
            lines.append(
                f"| {workers} | {LABELS[name]} | {rps:,.0f} | {front * per:.0f} | {nats_us} "
                f"| {worker * per:.0f} | {total * per:.0f} |"
            )
    return "\n".join(lines)


def against_push_table(data: dict, fraction: str = "0.90") -> str:
    """Shoal against the best push policy at each N: saturated throughput (the best push is
    the fastest) and p99 at `fraction` of Shoal's saturation (the best push is the lowest)."""
    lines = [
        "| workers | Shoal / best push, saturation "
        f"| Shoal / best push, p99 at {float(fraction):.0%} load |",
        "|---|---|---|",
    ]
    for workers, entry in sorted(data["by_workers"].items(), key=lambda kv: int(kv[0])):
        names = systems_of(entry)
        push = [n for n in names if n in PUSH]
        if "shoal" not in names or not push:
            continue
        shoal = entry["shoal"]
        best_rps = max(entry[n]["saturation"]["load"]["rps"] for n in push)
        rps_ratio = shoal["saturation"]["load"]["rps"] / best_rps
        p99s = [
            entry[n]["loads"][fraction]["load"]["p99_ms"]
            for n in push
            if fraction in entry[n]["loads"]
        ]
        if fraction in shoal["loads"] and p99s:
            p99 = shoal["loads"][fraction]["load"]["p99_ms"]
            p99_cell = f"{p99 / min(p99s):.2f} ({p99:.0f} / {min(p99s):.0f} ms)"
        else:
            p99_cell = "-"
        lines.append(f"| {workers} | {rps_ratio:.2f} | {p99_cell} |")
    return "\n".join(lines)


def plot(data: dict, stem: str, plots: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots.mkdir(parents=True, exist_ok=True)
    rows = sorted(data["by_workers"].items(), key=lambda kv: int(kv[0]))
    setup = data["setup"]
    title = f"{setup['runtime']}" + (
        f" (SIMULATED: batch_ms={setup['options'].get('batch_ms')}, "
        f"token_us={setup['options'].get('token_us')})"
        if setup.get("simulated")
        else f" ({setup['model']})"
    )
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [s for s in ORDER if any(s in systems_of(e) for _, e in rows)]
    for name in names:
        points = [
            (int(n), e[name]["saturation"]["load"]["rps"]) for n, e in rows if name in systems_of(e)
        ]
        ax.plot(*zip(*points, strict=True), marker="o", label=LABELS[name])
    one = next((e["shoal"]["saturation"]["load"]["rps"] for n, e in rows if n == "1"), None)
    if one:
        xs = [int(n) for n, _ in rows]
        ax.plot(xs, [x * one for x in xs], "k:", label="N x one Shoal worker")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("requests/s at saturation")
    ax.set_title(f"Throughput vs workers, {title}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    written.append(_save(fig, plots / f"{stem}_throughput.png"))

    for metric, ylabel, key in (
        ("busy", "worker busy fraction (mean; min dashed)", "busy"),
        ("p99", "p99 latency, ms (log where the spread is wide)", "p99"),
    ):
        panels = [(n, e) for n, e in rows if any(e[s]["loads"] for s in systems_of(e))]
        if not panels:
            continue
        columns = min(4, len(panels))
        grid_rows = -(-len(panels) // columns)
        fig, axes = plt.subplots(
            grid_rows, columns, figsize=(3.4 * columns, 3.2 * grid_rows), squeeze=False
        )
        cells = [ax for row in axes for ax in row]
        for ax in cells[len(panels) :]:
            ax.set_visible(False)
        for ax, (workers, entry) in zip(cells, panels, strict=False):
            for i, name in enumerate(systems_of(entry)):
                loads = entry[name]["loads"]
                xs = [float(f) for f in loads]
                color = f"C{i}"
                if key == "busy":
                    if loads[next(iter(loads))]["workers"] is None:
                        continue
                    ys = [loads[f]["workers"]["busy_mean"] for f in loads]
                    mins = [loads[f]["workers"]["busy_min"] for f in loads]
                    ax.plot(xs, ys, marker="o", color=color, label=LABELS[name])
                    ax.plot(xs, mins, linestyle="--", color=color, alpha=0.6)
                    ax.set_ylim(0, 1.05)
                else:
                    ys = [loads[f]["load"]["p99_ms"] for f in loads]
                    ax.plot(xs, ys, marker="o", color=color, label=LABELS[name])
            if key == "p99":
                low, high = min(ax.dataLim.y0, ax.dataLim.y1), max(ax.dataLim.y0, ax.dataLim.y1)
                # A peer that times out (tens of seconds) would flatten the others: log scale.
                if low > 0 and high / low > 20:
                    ax.set_yscale("log")
                else:
                    ax.set_ylim(0, high * 1.05)
            ax.set_title(f"{workers} workers", fontsize=9)
            ax.set_xlabel("offered load / Shoal's saturation")
            ax.grid(alpha=0.3)
        for row in axes:
            row[0].set_ylabel(ylabel, fontsize=8)
        cells[0].legend(fontsize=7)
        fig.suptitle(f"{'Busy fraction' if key == 'busy' else 'p99'} vs load, {title}", fontsize=9)
        written.append(_save(fig, plots / f"{stem}_{metric}.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=[str(RESULTS_DIR / "push_vs_pull_sim.json")])
    parser.add_argument("--plots", default="docs/img")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    for name in args.files:
        path = Path(name)
        data = json.loads(path.read_text())
        print(f"## {path.name}: {data['setup']}\n")
        print(saturation_table(data), "\n")
        scaling = scaling_table(data)
        if scaling:
            print(scaling, "\n")
        print(against_push_table(data), "\n")
        print(path_cpu_table(data), "\n")
        for workers in sorted(data["by_workers"], key=int):
            print(f"### {workers} workers, constant load\n")
            print(load_table(data, workers), "\n")
        if not args.no_plots:
            for written in plot(data, path.stem, Path(args.plots)):
                print(f"wrote {written}")


if __name__ == "__main__":
    main()
