#!/usr/bin/env python3
"""Sweeps `examples/bench.rs` over thread counts and key counts and plots the
throughput of idemstore check_and_set (fresh and duplicate) next to the hashbrown
ceiling, into docs/benchmarks.png. Also prints the memory-per-key sweep.

Usage: python3 scripts/plot_benchmarks.py [--keys 1000000,5000000,10000000,20000000]
Needs matplotlib (pip install matplotlib). Builds the example with cargo first.
"""
import argparse
import json
import subprocess
import sys


def run(keys, threads):
    out = subprocess.run(
        ["target/release/examples/bench", "--keys", str(keys), "--threads", str(threads),
         "--skip-peers", "--json"],
        check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def pick(result, prefix):
    for name, row in result["rows"].items():
        if name.startswith(prefix):
            return row["ops_per_s"]
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", default="1000000,5000000,10000000,20000000")
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--out", default="docs/benchmarks.png")
    args = parser.parse_args()
    subprocess.run(["cargo", "build", "--release", "--example", "bench"], check=True)

    by_threads = []
    for t in [int(x) for x in args.threads.split(",")]:
        r = run(1_000_000, t)
        by_threads.append((t, pick(r, "idemstore check_and_set fresh, interval"),
                           pick(r, "idemstore check_and_set duplicate, interval"),
                           pick(r, "ceiling: hashbrown insert")))
        print(f"threads={t}: fresh {by_threads[-1][1]:.0f}/s dup {by_threads[-1][2]:.0f}/s "
              f"ceiling {by_threads[-1][3]:.0f}/s", file=sys.stderr)
    by_keys = []
    for n in [int(x) for x in args.keys.split(",")]:
        r = run(n, 2)
        f = r["facts"]
        by_keys.append((n, pick(r, "idemstore check_and_set fresh, interval"),
                        pick(r, "idemstore check_and_set duplicate, interval"),
                        pick(r, "ceiling: hashbrown insert"),
                        float(f["memory per key, anonymous RSS delta (bytes)"]),
                        float(f["index bytes per key (table allocation)"]),
                        f.get(f"open (replay) of {n} keys (ms)"),
                        f.get(f"open of {n} keys from the checkpoint of a clean close (ms)")))
        print(f"keys={n}: fresh {by_keys[-1][1]:.0f}/s dup {by_keys[-1][2]:.0f}/s ceiling "
              f"{by_keys[-1][3]:.0f}/s anon RSS {by_keys[-1][4]:.1f} B/key index "
              f"{by_keys[-1][5]:.1f} B/key open {by_keys[-1][6]} ms (checkpoint {by_keys[-1][7]} ms)",
              file=sys.stderr)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    ts = [x[0] for x in by_threads]
    a.plot(ts, [x[1] / 1e6 for x in by_threads], "o-", label="check_and_set fresh")
    a.plot(ts, [x[2] / 1e6 for x in by_threads], "s-", label="check_and_set duplicate")
    a.plot(ts, [x[3] / 1e6 for x in by_threads], "^--", label="hashbrown insert, 1 thread")
    a.set_xlabel("threads")
    a.set_ylabel("million operations / s")
    a.set_title("1M keys, Interval mode")
    a.set_xticks(ts)
    a.legend()
    ks = [x[0] / 1e6 for x in by_keys]
    b.plot(ks, [x[1] / 1e6 for x in by_keys], "o-", label="check_and_set fresh")
    b.plot(ks, [x[2] / 1e6 for x in by_keys], "s-", label="check_and_set duplicate")
    b.plot(ks, [x[3] / 1e6 for x in by_keys], "^--", label="hashbrown insert, 1 thread")
    b.set_xlabel("keys (millions)")
    b.set_ylabel("million operations / s")
    b.set_title("2 threads, Interval mode")
    b.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(json.dumps({"by_threads": by_threads, "by_keys": by_keys}))


if __name__ == "__main__":
    main()
