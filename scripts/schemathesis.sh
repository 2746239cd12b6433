#!/usr/bin/env bash
# Schemathesis against a real `rein api`: a fresh database on the PostgreSQL of DATABASE_URL
# (default postgres://postgres@127.0.0.1:5432/postgres), migrated, an admin token, the debug
# binary's API on 127.0.0.1 with a redaction key, and `st run` on the document it serves:
# every check, every phase (stateful included), SCHEMATHESIS_EXAMPLES (25) examples per
# operation. No worker or scheduler runs, so nothing the generated data names is ever
# called: all traffic goes to 127.0.0.1. The database is dropped and the API stopped on exit.
#
#   scripts/schemathesis.sh [extra `st run` flags]
#
# Schemathesis installs with pip into target/schemathesis-venv, pinned below. Its reports
# (JUnit, NDJSON) go to target/schemathesis-report.
set -euo pipefail
cd "$(dirname "$0")/.."

SCHEMATHESIS_VERSION=4.32.5
TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
REIN=${REIN_BIN:-$TARGET_DIR/debug/rein}
VENV=$TARGET_DIR/schemathesis-venv
REPORT=$TARGET_DIR/schemathesis-report
EXAMPLES=${SCHEMATHESIS_EXAMPLES:-25}
BASE=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}

note() { echo "schemathesis.sh: $*" >&2; }

[[ -x $REIN ]] || { note "no rein binary at $REIN: run \`cargo build --bin rein\` or set REIN_BIN"; exit 1; }
if [[ $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("schemathesis"))' 2>/dev/null) != "$SCHEMATHESIS_VERSION" ]]; then
  note "pip install schemathesis==$SCHEMATHESIS_VERSION into $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$SCHEMATHESIS_VERSION"
fi

db=rein_schemathesis_$$_$RANDOM
url=${BASE%/*}/$db
work=$(mktemp -d)
api_pid=
cleanup() {
  [[ -n $api_pid ]] && kill "$api_pid" 2>/dev/null && wait "$api_pid" 2>/dev/null
  psql "$BASE" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
psql "$BASE" -qc "CREATE DATABASE $db"
"$REIN" migrate --database-url "$url" >/dev/null
token=$("$REIN" tokens create --database-url "$url" --subject schemathesis --scope admin 2>/dev/null)
# A redaction key for this run only: `POST /v1/runs/{id}/redact` is tested, not refused.
REIN_REDACTION_KEY=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n') REIN_LOG=warn \
  "$REIN" api --listen 127.0.0.1:0 --database-url "$url" >"$work/api.out" 2>"$work/api.err" &
api_pid=$!
for _ in $(seq 100); do
  [[ -s $work/api.out ]] && break
  kill -0 "$api_pid" 2>/dev/null || { cat "$work/api.err" >&2; exit 1; }
  sleep 0.1
done
api=$(head -1 "$work/api.out")
[[ $api == http://127.0.0.1:* ]] || { note "the API printed no loopback address: $api"; exit 1; }
note "rein api at $api (database $db)"

# From the scratch directory: Schemathesis leaves its cache (.schemathesis/) where it runs.
config=$PWD/scripts/schemathesis.toml
cd "$work"
"$VENV/bin/st" --config-file "$config" run "$api/openapi.json" --url "$api" \
  --checks all --max-examples "$EXAMPLES" --phases examples,coverage,fuzzing,stateful \
  --header "Authorization: Bearer $token" --report junit,ndjson --report-dir "$REPORT" "$@"
