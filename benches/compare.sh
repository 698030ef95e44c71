#!/usr/bin/env bash
# proctor's steps/s against the bare design (benches/bare.rs), side by side in one
# session: for each concurrency (procedures in flight), ROUNDS rounds that alternate
# the four runs (bare durable, proctor WAL, bare memory, proctor memory), then the
# medians and the ratios proctor / bare. Needs python3 for the table.
#
#   benches/compare.sh                 # 100 000 procedures, 3 rounds, 1 000 and 20 000 in flight
#   PROCS=50000 ROUNDS=5 benches/compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PROCS=${PROCS:-100000}
ROUNDS=${ROUNDS:-3}
CONCURRENCY=${CONCURRENCY:-"1000 20000"}

cargo build --release --example workload --bench bare >&2
workload=target/release/examples/workload
bare=$(ls -t target/release/deps/bare-* | grep -v '\.d$' | head -n 1)

out=$(mktemp)
for c in $CONCURRENCY; do
  for round in $(seq "$ROUNDS"); do
    echo "concurrency $c, round $round" >&2
    printf 'bare wal %s %s\n' "$c" "$("$bare" --procs "$PROCS" --concurrency "$c" | tail -n 1)" >>"$out"
    printf 'proctor wal %s %s\n' "$c" "$("$workload" --store wal --procs "$PROCS" --steps 3 --concurrency "$c" | tail -n 1)" >>"$out"
    printf 'bare memory %s %s\n' "$c" "$("$bare" --procs "$PROCS" --concurrency "$c" --memory | tail -n 1)" >>"$out"
    printf 'proctor memory %s %s\n' "$c" "$("$workload" --store memory --procs "$PROCS" --steps 3 --concurrency "$c" | tail -n 1)" >>"$out"
  done
done

python3 - "$out" <<'EOF'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    design, store, c, report = line.split(" ", 3)
    runs.setdefault((int(c), store, design), []).append(json.loads(report)["steps_per_s"])
print("| in flight | store | bare steps/s (median; runs) | proctor steps/s (median; runs) | proctor / bare |")
print("| ---: | --- | --- | --- | ---: |")
for (c, store) in sorted({(c, s) for (c, s, _) in runs}):
    b, p = runs[(c, store, "bare")], runs[(c, store, "proctor")]
    fmt = lambda xs: f"{statistics.median(xs):,.0f}; " + " · ".join(f"{x:,.0f}" for x in xs)
    print(f"| {c:,} | {store} | {fmt(b)} | {fmt(p)} | {statistics.median(p) / statistics.median(b):.3f} |")
EOF
rm -f "$out"
