#!/usr/bin/env bash
# Measures how fast `rein api` answers /healthz while it replays runs' logs: for 30 s, two
# clients keep asking for what-ifs within the replay budget (so both replay threads are busy)
# and two keep asking for what-ifs over it (refused with 422), while /healthz is asked every
# 50 ms. Prints the /healthz latency's p50 and p99 and how the what-ifs were answered.
#
#   DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres scripts/replay-healthz.sh
#
# Makes a database of its own on DATABASE_URL's server (dropped at the end), starts the API on
# a loopback port and stops it at the end; everything is bounded (SECONDS_MEASURED, 600
# probes). REIN_BIN picks the binary (default target/debug/rein, built by `cargo build`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

REIN=${REIN_BIN:-target/debug/rein}
SECONDS_MEASURED=${SECONDS_MEASURED:-30}
: "${DATABASE_URL:?set DATABASE_URL to a PostgreSQL server this script may create a database on}"
DB="rein_replay_healthz_$$"
URL="${DATABASE_URL%/*}/$DB"
WORK=$(mktemp -d)
API_PID=
cleanup() {
  [[ -n $API_PID ]] && kill "$API_PID" 2>/dev/null && wait "$API_PID" 2>/dev/null
  psql -q "$DATABASE_URL" -c "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

psql -q "$DATABASE_URL" -c "CREATE DATABASE $DB" >/dev/null
"$REIN" migrate --database-url "$URL" >/dev/null

# PING keeps a run in A behind five scans of its items: some 900,000 steps an event by the
# guards' cost model, so a what-if of more than 83 events is over REPLAY_COST_MAX.
guard=$(for i in 0 1 2 3 4; do printf "!run.data.items.exists(i, i == 'x%s') && " "$i"; done)
cat >"$WORK/looping.toml" <<EOF
name = "looping"
version = 1
events = ["PING"]
cancel_state = "DONE"
[[states]]
name = "A"
kind = "waiting"
initial = true
[[states]]
name = "DONE"
kind = "terminal"
[[transitions]]
from = "A"
event = "PING"
to = "A"
guard = "${guard% && }"
EOF
"$REIN" definitions register "$WORK/looping.toml" --database-url "$URL" >/dev/null
items=$(python3 -c 'import json; print(json.dumps({"items": [f"item-{i}" for i in range(300)]}))')
run_with() {
  local run
  run=$("$REIN" enqueue --definition looping --input "$items" --database-url "$URL")
  for _ in $(seq "$1"); do "$REIN" send "$run" PING --database-url "$URL" >/dev/null; done
  echo "$run"
}
within=$(run_with 80)
over=$(run_with 90)
token() { "$REIN" tokens create --database-url "$URL" --subject "$1" --scope read 2>/dev/null; }

"$REIN" api --database-url "$URL" --listen 127.0.0.1:0 >"$WORK/api.out" 2>"$WORK/api.err" &
API_PID=$!
for _ in $(seq 100); do [[ -s $WORK/api.out ]] && break; sleep 0.1; done
BASE=$(head -1 "$WORK/api.out")
[[ $BASE == http://127.0.0.1:* ]] || { echo "the API did not start: $(cat "$WORK/api.err")" >&2; exit 1; }

# Asks for the what-if of run $2 with token $3 until the time is up; one status a line in $1.
ask() {
  local out=$1 run=$2 secret=$3 end=$((SECONDS + SECONDS_MEASURED))
  while ((SECONDS < end)); do
    curl -s -o /dev/null -w '%{http_code}\n' --max-time 60 \
      -H "Authorization: Bearer $secret" "$BASE/v1/runs/$run/whatif" >>"$out" || echo "000" >>"$out"
    [[ $run == "$over" ]] && sleep 0.1
  done
}
ASKING=()
for who in within-a within-b over-a over-b; do
  run=$within
  [[ $who == over-* ]] && run=$over
  secret=$(token "$who")
  ask "$WORK/$who" "$run" "$secret" &
  ASKING+=($!)
done
sleep 1
for _ in $(seq $((SECONDS_MEASURED * 20))); do
  curl -s -o /dev/null -w '%{time_total}\n' --max-time 10 "$BASE/healthz" >>"$WORK/healthz" \
    || echo "10" >>"$WORK/healthz"
  sleep 0.05
done
wait "${ASKING[@]}"

sort -n "$WORK/healthz" | awk '{ v[NR] = $1 } END {
  printf "healthz: %d probes, p50 %.1f ms, p99 %.1f ms, max %.1f ms\n", NR,
    1000 * v[int(NR * 0.50 + 0.5)], 1000 * v[int(NR * 0.99 + 0.5)], 1000 * v[NR] }'
for f in within-a within-b over-a over-b; do
  printf "%s: %s\n" "$f" "$(sort "$WORK/$f" | uniq -c | awk '{ printf "%s x%s  ", $2, $1 }')"
done
