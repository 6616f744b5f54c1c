#!/usr/bin/env python3
"""Plots the cold tier's sweep (keys x memory budget, beside the all-in-RAM index)
from the logs of `examples/cold_bench.rs` into docs/cold_tier.png, and prints the
figures as a Markdown table.

Usage:
    scripts/cold_sweep.sh /work            # writes target/cold-sweep/*.log (~25 min)
    python3 scripts/plot_cold_tier.py target/cold-sweep/*.log [more.log ...]

Each log holds one or two configurations (`== budget 16 MiB, N keys` or
`== no budget (all in RAM), N keys`) and, unless COLD_BENCH_NO_REPLAY was set, the
open after kill -9 that follows each. Needs matplotlib (pip install matplotlib).
"""
import argparse
import re
import sys

RATE = re.compile(r"^\s+(?P<what>.+?)\s+(?P<rate>[\d.]+) M/s\s+p50\s+(?P<p50>[\d.]+) µs\s+"
                  r"p99\s+(?P<p99>[\d.]+) µs")


def duration_s(text):
    """A Rust `{:.2?}` Duration: 438.12ms, 4.09s, 812.00µs."""
    m = re.match(r"([\d.]+)(ns|µs|ms|s)", text)
    scale = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]
    return float(m.group(1)) * scale


def parse(path):
    runs, cur = [], None
    for line in open(path, encoding="utf-8"):
        head = re.match(r"== (budget (\d+) MiB|no budget \(all in RAM\)), (\d+) keys", line)
        if head:
            cur = {"budget": int(head.group(2)) if head.group(2) else None,
                   "keys": int(head.group(3)), "log": path}
            runs.append(cur)
            continue
        if cur is None:
            continue
        m = RATE.match(line)
        if m:
            key = {"fresh check_and_set, 2 threads": "fresh",
                   "duplicates, spread over every key": "dup",
                   "fresh keys after the spill": "fresh_after"}.get(m.group("what"))
            if key:
                cur[key] = float(m.group("rate"))
                cur[key + "_p99"] = float(m.group("p99"))
                cur[key + "_p50"] = float(m.group("p50"))
            continue
        m = re.search(r"anonymous RSS ([\d.]+) B/key \(peak while writing ([\d.]+) B/key\); "
                      r"disk ([\d.]+) B/key", line)
        if m:
            cur["rss"], cur["peak"], cur["disk"] = map(float, m.groups())
            continue
        m = re.search(r"final spill (\S+); hot index ([\d.]+) B/key, cold RAM ([\d.]+) B/key", line)
        if m:
            cur["spill_s"] = duration_s(m.group(1))
            cur["cold_ram"] = float(m.group(3))
            continue
        m = re.search(r"reopen after kill -9 ([\d.]+\S+?)[ ,]", line)
        if m:
            cur["crash_open_s"] = duration_s(m.group(1))
    return runs


def label(run):
    return "all in RAM" if run["budget"] is None else f"budget {run['budget']} MiB"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--out", default="docs/cold_tier.png")
    args = parser.parse_args()
    runs = [r for path in args.logs for r in parse(path) if "fresh" in r and "rss" in r]
    if not runs:
        sys.exit("no complete cold_bench run in the logs given")
    runs.sort(key=lambda r: (r["keys"], r["budget"] is None, r["budget"] or 0))

    print("| keys | configuration | anon. RSS after spill B/key | peak while writing B/key | "
          "fresh M/s (p99 µs) | cold duplicates M/s (p50 / p99 µs) | fresh after spill M/s "
          "(p99 µs) | disk B/key | open after kill -9 s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        crash = f"{r['crash_open_s']:.2f}" if "crash_open_s" in r else "—"
        print(f"| {r['keys'] / 1e6:g}M | {label(r)} | {r['rss']:.2f} | {r['peak']:.1f} | "
              f"{r['fresh']:.2f} ({r['fresh_p99']:.2f}) | {r.get('dup', 0):.2f} "
              f"({r.get('dup_p50', 0):.2f} / {r.get('dup_p99', 0):.2f}) | "
              f"{r.get('fresh_after', 0):.2f} ({r.get('fresh_after_p99', 0):.2f}) | "
              f"{r['disk']:.1f} | {crash} |")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {}
    for r in runs:
        series.setdefault(label(r), []).append(r)
    fig, (rss, fresh, dup) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, rs in sorted(series.items(), key=lambda kv: (kv[0] != "all in RAM", kv[0])):
        xs = [r["keys"] / 1e6 for r in rs]
        style = dict(marker="o", linestyle="--" if name == "all in RAM" else "-", label=name)
        rss.plot(xs, [r["rss"] for r in rs], **style)
        fresh.plot(xs, [r["fresh"] for r in rs], **style)
        dup.plot(xs, [r.get("dup_p99", 0) for r in rs], **style)
    rss.axhline(3.0, color="grey", linewidth=0.8, linestyle=":")
    rss.text(10, 3.2, "issue 11 target: 3 B/key", color="grey", fontsize=8)
    fresh.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    for ax, title, ylabel in (
            (rss, "RAM per key after the final spill", "anonymous RSS, bytes / key"),
            (fresh, "fresh check_and_set, 2 threads", "million calls / s"),
            (dup, "duplicates spread over every key, p99", "µs (log)")):
        ax.set_xscale("log")
        ax.set_xlabel("live 16-byte keys (millions, log)")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    rss.set_yscale("log")
    dup.set_yscale("log")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
