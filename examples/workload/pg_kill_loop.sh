#!/usr/bin/env bash
# The workload's kill loop against PostgreSQL, with a standby each round.
#
#   URL="host=127.0.0.1 port=5432 user=postgres dbname=postgres" \
#     examples/workload/pg_kill_loop.sh ROUNDS [FLAGS...]
#
# Each round, over one schema and one ledger: a leader (`--procs 200000`) starts and
# leads; a standby (`--standby --verify`) starts beside it and waits for the lease; the
# leader is SIGKILLed at a random moment 0.5-2.0 s later; the standby takes the lease
# once it expires, runs what the leader left, verifies every root and the whole ledger,
# and prints its JSON line. Exits non-zero if any round had a violation.
# Build first: cargo build --release --example workload
set -u
W=${W:-target/release/examples/workload}
URL=${URL:?set URL to the database}
ROUNDS=${1:?rounds}
shift
SCHEMA=kill_loop_$$_$RANDOM
DIR=$(mktemp -d)
pg=(--store postgres --pg "$URL" --pg-schema "$SCHEMA" --lease-ms 1000 --ledger "$DIR/ledger")
failed=0
for round in $(seq 1 "$ROUNDS"); do
  "$W" "${pg[@]}" --holder "leader-$round" --procs 200000 --seed "$round" "$@" \
    >/dev/null 2>"$DIR/leader-$round.err" &
  leader=$!
  until grep -q " leads (lease epoch" "$DIR/leader-$round.err"; do
    kill -0 "$leader" 2>/dev/null || { cat "$DIR/leader-$round.err"; exit 1; }
    sleep 0.05
  done
  "$W" "${pg[@]}" --holder "standby-$round" --standby --verify "$@" \
    >"$DIR/standby-$round.json" 2>"$DIR/standby-$round.err" &
  standby=$!
  sleep "$(awk -v s="$RANDOM" 'BEGIN { srand(s); printf "%.2f", 0.5 + 1.5 * rand() }')"
  kill -9 "$leader"
  wait "$leader" 2>/dev/null
  wait "$standby" || failed=1
  echo "round $round: $(tail -1 "$DIR/standby-$round.json")"
  grep -m5 "violation" "$DIR/standby-$round.err"
done
echo "ledger: $(wc -l <"$DIR/ledger") lines in $DIR"
exit $failed
