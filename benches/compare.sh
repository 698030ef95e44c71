#!/usr/bin/env bash
# proctor against the bare design (benches/bare.rs), side by side in one session:
#
# 1. steps/s: for each concurrency (procedures in flight), ROUNDS rounds that alternate
#    the four runs (bare durable, proctor WAL, bare memory, proctor memory); then the
#    medians, the ranges and the ratios proctor / bare; and the same runs' CPU time per
#    step (the process's, every thread's), steadier than steps/s on a noisy machine,
#    with bare's ÷ proctor's (a throughput-like ratio: 0.5 is half bare's efficiency);
# 2. instructions per step (valgrind's callgrind, memory stores, 3 steps each): the
#    total of a run of INSTR_PROCS procedures ÷ its steps, and the marginal cost between
#    INSTR_PROCS and 2·INSTR_PROCS procedures (which leaves out start-up); with the same
#    runs' allocations (calls into the allocator), memcpy calls and actix messages
#    handled, per step, for the bare design, the design's empty shape
#    (`benches/shape.rs --batch`) and proctor;
# 3. bytes per idle procedure (`benches/idle.rs --procs IDLE`: each design, and proctor on
#    each store, in a process of its own; live heap bytes and resident-set growth);
# 4. recovery ÷ raw read (`benches/recovery.rs --start` with RECOVERY_PROCS procedures:
#    open and plan, and an executor's whole start);
# 5. scaling with cores: for each concurrency in SCALE (WAL store), ROUNDS rounds that
#    alternate bare on 1 and 2 arbiters and proctor on 1 and 2 shards; each design's
#    2 ÷ 1 ratio of median steps/s, and proctor's ratio ÷ bare's (1.0: proctor grows
#    with a second core as much as the bare design does).
#
# Needs python3 for the tables; skips 2 without valgrind. Set INSTR_PROCS, IDLE or
# RECOVERY_PROCS to 0, or SCALE to "", to skip that part. RAW=FILE keeps the runs' lines
# there (appended to, so a rerun of the tables alone is `SCALE= ROUNDS=0 ... RAW=FILE`). Honours CARGO_TARGET_DIR and CARGO_BUILD_JOBS.
#
#   benches/compare.sh                 # 100 000 procedures, 3 rounds, 1 000 and 20 000 in flight
#   PROCS=50000 ROUNDS=5 RECOVERY_PROCS=200000 benches/compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PROCS=${PROCS:-100000}
ROUNDS=${ROUNDS:-3}
CONCURRENCY=${CONCURRENCY:-"1000 20000"}
INSTR_PROCS=${INSTR_PROCS:-5000}
IDLE=${IDLE:-100000}
RECOVERY_PROCS=${RECOVERY_PROCS:-1000000}
SCALE=${SCALE-"1000 20000"}

# The executables, as cargo reports them (wherever the target directory is).
executables=$(cargo build --release --example workload --bench bare --bench shape --bench idle --bench recovery \
  --message-format=json-render-diagnostics | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])
')
exe() { awk -v n="$1" '$1 == n { print $2 }' <<<"$executables"; }
workload=$(exe workload)
bare=$(exe bare)
shape=$(exe shape)
idle=$(exe idle)
recovery=$(exe recovery)

out=${RAW:-$(mktemp)}
trap 'rm -f callgrind.compare.*; [ -n "${RAW:-}" ] || rm -f "$out"' EXIT
for c in $CONCURRENCY; do
  for round in $(seq "$ROUNDS"); do
    echo "concurrency $c, round $round" >&2
    printf 'bare wal %s %s\n' "$c" "$("$bare" --procs "$PROCS" --concurrency "$c" | tail -n 1)" >>"$out"
    printf 'proctor wal %s %s\n' "$c" "$("$workload" --store wal --procs "$PROCS" --steps 3 --concurrency "$c" | tail -n 1)" >>"$out"
    printf 'bare memory %s %s\n' "$c" "$("$bare" --procs "$PROCS" --concurrency "$c" --memory | tail -n 1)" >>"$out"
    printf 'proctor memory %s %s\n' "$c" "$("$workload" --store memory --procs "$PROCS" --steps 3 --concurrency "$c" | tail -n 1)" >>"$out"
  done
done

for c in $SCALE; do
  for round in $(seq "$ROUNDS"); do
    for n in 1 2; do
      echo "scaling, concurrency $c, $n shards, round $round" >&2
      printf 'scale-bare %s %s %s\n' "$n" "$c" "$("$bare" --procs "$PROCS" --concurrency "$c" --arbiters "$n" | tail -n 1)" >>"$out"
      printf 'scale-proctor %s %s %s\n' "$n" "$c" "$("$workload" --store wal --procs "$PROCS" --steps 3 --concurrency "$c" --shards "$n" | tail -n 1)" >>"$out"
    done
  done
done

# Counts of one run under callgrind: total instructions, calls into the allocator
# (malloc, zeroed, realloc), memcpy calls and actix messages handled (envelopes).
counts() {
  local file
  file=$(mktemp callgrind.compare.XXXXXX)
  valgrind --tool=callgrind --callgrind-out-file="$file" "$@" >/dev/null 2>&1
  python3 - "$file" <<'PY'
import re, sys
names, cfn, calls = {}, None, {"alloc": 0, "memcpy": 0, "messages": 0}
kinds = [
    ("alloc", re.compile(r"^(mi_malloc_aligned|mi_zalloc_aligned|mi_realloc_aligned|malloc|calloc|realloc)$")),
    ("memcpy", re.compile(r"^__memcpy")),
    ("messages", re.compile(r"SyncEnvelopeProxy<M> as actix::address::envelope::EnvelopeProxy<A>>::handle$")),
]
total = 0
for line in open(sys.argv[1], errors="replace"):
    if line.startswith("summary:"):
        total = int(line.split()[1])
    m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line)
    if m:
        if m.group(2):
            names[m.group(1)] = m.group(2).strip()
        cfn = names.get(m.group(1)) if line.startswith("cfn=") else None
    elif line.startswith("calls=") and cfn:
        for kind, rx in kinds:
            if rx.search(cfn):
                calls[kind] += int(line.split("=")[1].split()[0])
        cfn = None
print(total, calls["alloc"], calls["memcpy"], calls["messages"])
PY
  rm -f "$file"
}
if [ "$INSTR_PROCS" -gt 0 ] && command -v valgrind >/dev/null; then
  for n in "$INSTR_PROCS" $((2 * INSTR_PROCS)); do
    echo "callgrind, $n procedures" >&2
    printf 'instr bare %s %s\n' "$n" "$(counts "$bare" --procs "$n" --steps 3 --concurrency 1000 --memory)" >>"$out"
    printf 'instr shape %s %s\n' "$n" "$(counts "$shape" --procs "$n" --steps 3 --concurrency 1000 --memory --batch)" >>"$out"
    printf 'instr proctor %s %s\n' "$n" "$(counts "$workload" --store memory --procs "$n" --steps 3 --concurrency 1000)" >>"$out"
  done
fi

if [ "$IDLE" -gt 0 ]; then
  echo "idle, $IDLE procedures" >&2
  printf 'idle - - %s\n' "$("$idle" --procs "$IDLE" | tail -n 1)" >>"$out"
fi

if [ "$RECOVERY_PROCS" -gt 0 ]; then
  echo "recovery, $RECOVERY_PROCS procedures" >&2
  printf 'recovery - - %s\n' "$("$recovery" "$RECOVERY_PROCS" --start | tail -n 1)" >>"$out"
fi

python3 - "$out" <<'EOF'
import json, statistics, sys
runs, cpu, instr, idle, recovery, scale = {}, {}, {}, None, None, {}
for line in open(sys.argv[1]):
    kind, store, c, report = line.rstrip("\n").split(" ", 3)
    if kind.startswith("scale-"):
        # `store` is the number of shards (arbiters, for bare).
        scale.setdefault((int(c), kind[6:], int(store)), []).append(json.loads(report)["steps_per_s"])
    elif kind == "instr":
        instr[(store, int(c))] = [int(x) for x in report.split()]
    elif kind == "idle":
        idle = json.loads(report)
    elif kind == "recovery":
        recovery = json.loads(report)
    else:
        r = json.loads(report)
        runs.setdefault((int(c), store, kind), []).append(r["steps_per_s"])
        if "cpu_us_per_step" in r:
            cpu.setdefault((int(c), store, kind), []).append(r["cpu_us_per_step"])

def cell(xs):
    return f"{statistics.median(xs):,.0f} ({min(xs):,.0f} – {max(xs):,.0f}; " + " · ".join(f"{x:,.0f}" for x in xs) + ")"

print("| in flight | store | bare steps/s: median (range; runs) | proctor steps/s: median (range; runs) | proctor / bare |")
print("| ---: | --- | --- | --- | ---: |")
for (c, store) in sorted({(c, s) for (c, s, _) in runs}):
    b, p = runs[(c, store, "bare")], runs[(c, store, "proctor")]
    print(f"| {c:,} | {store} | {cell(b)} | {cell(p)} | {statistics.median(p) / statistics.median(b):.3f} |")

if cpu:
    print()
    print("| in flight | store | bare CPU µs per step: median (runs) | proctor CPU µs per step: median (runs) | bare ÷ proctor |")
    print("| ---: | --- | --- | --- | ---: |")
    for (c, store) in sorted({(c, s) for (c, s, _) in cpu}):
        b, p = cpu.get((c, store, "bare")), cpu.get((c, store, "proctor"))
        if b and p:
            runs_of = lambda xs: " · ".join(f"{x:.2f}" for x in xs)
            print(f"| {c:,} | {store} | {statistics.median(b):.2f} ({runs_of(b)}) | {statistics.median(p):.2f} ({runs_of(p)}) | {statistics.median(b) / statistics.median(p):.3f} |")

if instr:
    print()
    designs = ("bare", "shape", "proctor")
    sizes = sorted({n for (_, n) in instr})
    what = ("instructions", "allocations", "memcpy calls", "actix messages")
    print("| per step (callgrind, memory stores, 3 steps a procedure) | bare | shape --batch | proctor | proctor / shape |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for i, name in enumerate(what):
        for n in sizes:
            per = {d: instr[(d, n)][i] / (3 * n) for d in designs}
            fmt = "{:,.0f}" if i == 0 else "{:,.1f}"
            cells = " | ".join(fmt.format(per[d]) for d in designs)
            print(f"| {name}, total ÷ steps, {n:,} procedures | {cells} | {per['proctor'] / per['shape']:.2f} |")
        if len(sizes) == 2:
            lo, hi = sizes
            m = {d: (instr[(d, hi)][i] - instr[(d, lo)][i]) / (3 * (hi - lo)) for d in designs}
            fmt = "{:,.0f}" if i == 0 else "{:,.1f}"
            cells = " | ".join(fmt.format(m[d]) for d in designs)
            print(f"| {name}, marginal {lo:,} → {hi:,} procedures | {cells} | {m['proctor'] / m['shape']:.2f} |")

if idle:
    print()
    print(f"| bytes per idle procedure ({idle['idle_procs']:,}) | bare | proctor, memory store | proctor, WAL store |")
    print("| --- | ---: | ---: | ---: |")
    for what, name in (("live", "live heap"), ("rss", "resident set")):
        b, p, w = (idle[f"{d}_{what}_bytes_per_idle_proc"] for d in ("bare", "proctor", "proctor_wal"))
        print(f"| {name} | {b:,.0f} | {p:,.0f} ({p / b:.1f}x) | {w:,.0f} ({w / b:.1f}x) |")

if scale:
    print()
    print("| in flight (WAL) | bare steps/s, 1 → 2 arbiters (medians) | bare 2 ÷ 1 | proctor steps/s, 1 → 2 shards (medians) | proctor 2 ÷ 1 | proctor's ratio ÷ bare's |")
    print("| ---: | --- | ---: | --- | ---: | ---: |")
    for c in sorted({c for (c, _, _) in scale}):
        m = {(d, n): statistics.median(scale[(c, d, n)]) for d in ("bare", "proctor") for n in (1, 2)}
        rb, rp = m[("bare", 2)] / m[("bare", 1)], m[("proctor", 2)] / m[("proctor", 1)]
        print(f"| {c:,} | {m[('bare', 1)]:,.0f} → {m[('bare', 2)]:,.0f} | {rb:.2f} | {m[('proctor', 1)]:,.0f} → {m[('proctor', 2)]:,.0f} | {rp:.2f} | {rp / rb:.2f} |")

if recovery:
    print()
    print(f"recovery ({recovery['procs']:,} procedures, {recovery['wal_bytes_on_disk'] / 1e6:,.0f} MB on disk): "
          f"open + load + plan {recovery['recover_s']} s, raw read {recovery['raw_read_s']} s, "
          f"ratio {recovery['recover_over_raw_read']}; an executor's whole start {recovery['start_s']} s, "
          f"ratio {recovery['start_over_raw_read']}")
EOF
