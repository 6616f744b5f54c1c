#!/bin/bash
# The cold tier's sweep for docs/BENCHMARKS.md: keys (10M, 100M) x memory budget
# (16, 64, 256, 1024 MiB), the 16 MiB budget beside the all-in-RAM index, each a run of
# examples/cold_bench.rs, one log per point in target/cold-sweep/. About 25 minutes and 12 GB of free disk in DIR
# (default /tmp) on the 2-core machine of docs/BENCHMARKS.md. Then:
#   python3 scripts/plot_cold_tier.py target/cold-sweep/*.log
# The billion-key point is a one-off run of its own (docs/BENCHMARKS.md gives it).
set -euo pipefail
dir=${1:-/tmp}
cd "$(dirname "$0")/.."
cargo build --release --example cold_bench
bench=${COLD_BENCH:-target/release/examples/cold_bench}
mkdir -p target/cold-sweep
# At 10M keys the whole index (~150 MB) fits a 256 MiB budget: nothing spills there.
for spec in "10000000 16" "10000000 64 budget-only" "10000000 256 budget-only" \
            "100000000 16" "100000000 1024 budget-only"; do
  set -- $spec
  # At 100M keys, 200,000 duplicates per phase (each a page read when the cache is cold).
  if [ "$1" = 100000000 ]; then export COLD_BENCH_DUPS=200000; else unset COLD_BENCH_DUPS; fi
  echo "$(date +%T) cold_bench $spec" >&2
  "$bench" "$1" "$2" "$dir" ${3:-} > "target/cold-sweep/$1-$2.log" 2>&1
done
