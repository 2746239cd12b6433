#!/usr/bin/env bash
# A Rein fleet as local processes on one Linux machine: the topology of
# deploy/docker-compose.yml without containers. Each process runs in its own process group,
# logs to $FLEET_DIR/logs/NAME.log and records its pid in $FLEET_DIR/pids/NAME.pid.
#
#   deploy/local/fleet.sh up [--workers N]   migrate, then api, scheduler-a, scheduler-b and
#                                            worker-1..N (default 2)
#   deploy/local/fleet.sh status             each process: alive or not, pid, log tail
#   deploy/local/fleet.sh kill NAME          kill -9 one process (chaos drills)
#   deploy/local/fleet.sh start NAME         start one process again (after `kill`)
#   deploy/local/fleet.sh logs NAME          follow one process's log
#   deploy/local/fleet.sh stop               SIGTERM all, wait for the grace period, SIGKILL
#                                            what is left; never leaves a process behind
#
# Environment:
#   DATABASE_URL             PostgreSQL for every role (required unless all three below are set).
#                            Any PostgreSQL 14+ will do, e.g. an empty database made with
#                            `createdb -h 127.0.0.1 -U postgres rein_fleet`
#                            (DATABASE_URL=postgres://postgres@127.0.0.1:5432/rein_fleet), or
#                            the private server `rein demo --keep` starts and prints.
#   REIN_OWNER_DATABASE_URL  login that runs `rein migrate` (default: DATABASE_URL)
#   REIN_WORKER_DATABASE_URL login of workers and schedulers (default: DATABASE_URL)
#   REIN_API_DATABASE_URL    login of the API (default: DATABASE_URL)
#   REIN_BIN                 the rein binary (default: target/release/rein, else `rein` on PATH)
#   FLEET_DIR                state directory (default: .rein/fleet in the repository)
#   FLEET_API_LISTEN         API address (default 127.0.0.1:7878)
#   FLEET_SCHEDULER_PORT     first scheduler metrics port (default 9465; scheduler-b: +1)
#   FLEET_WORKER_PORT        worker-1's metrics port (default 9471; worker-N: +N-1)
#   FLEET_WORKER_POOL        --db-pool-max of each worker (default 4)
#   FLEET_SHUTDOWN_GRACE_MS  workers' --shutdown-grace-ms (default 10000); `stop` waits this
#                            long plus 5 s before SIGKILL
#   FLEET_TAIL               log lines shown per process by `status` (default 2)
#   REIN_LOG                 log filter passed to every process (default info,sqlx=warn)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
FLEET_DIR=${FLEET_DIR:-$REPO/.rein/fleet}
LOGS=$FLEET_DIR/logs
PIDS=$FLEET_DIR/pids
API_LISTEN=${FLEET_API_LISTEN:-127.0.0.1:7878}
SCHEDULER_PORT=${FLEET_SCHEDULER_PORT:-9465}
WORKER_PORT=${FLEET_WORKER_PORT:-9471}
WORKER_POOL=${FLEET_WORKER_POOL:-4}
SHUTDOWN_GRACE_MS=${FLEET_SHUTDOWN_GRACE_MS:-10000}
TAIL_LINES=${FLEET_TAIL:-2}
export REIN_LOG=${REIN_LOG:-info,sqlx=warn}

die() {
  echo "fleet: $*" >&2
  exit 1
}

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

rein_bin() {
  if [[ -n ${REIN_BIN:-} ]]; then
    [[ -x $REIN_BIN ]] || command -v "$REIN_BIN" >/dev/null ||
      die "REIN_BIN=$REIN_BIN is not an executable"
    echo "$REIN_BIN"
  elif [[ -x $REPO/target/release/rein ]]; then
    echo "$REPO/target/release/rein"
  elif command -v rein >/dev/null; then
    command -v rein
  else
    die "no rein binary: build it (cargo build --release) or set REIN_BIN"
  fi
}

# --- process bookkeeping ---------------------------------------------------------------
# A pid file holds "PID STARTTIME" (field 22 of /proc/PID/stat), so a recycled pid is never
# mistaken for a fleet process.

start_time() {
  local stat fields
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  read -r -a fields <<<"${stat##*) }"
  # fields[0] is the state (field 3), fields[19] the start time (field 22).
  [[ ${fields[0]} != Z ]] || return 1
  echo "${fields[19]}"
}

# Prints the pid of NAME if that process is alive; fails otherwise.
live_pid() {
  local file=$PIDS/$1.pid pid started now
  [[ -f $file ]] || return 1
  read -r pid started <"$file" || return 1
  now=$(start_time "$pid") || return 1
  [[ $now == "$started" ]] || return 1
  echo "$pid"
}

members() {
  local f
  shopt -s nullglob
  for f in "$PIDS"/*.pid; do
    f=${f##*/}
    echo "${f%.pid}"
  done | sort -V
  shopt -u nullglob
}

# The command line of NAME, one argument per line (from its .cmd file).
command_of() {
  [[ -f $PIDS/$1.cmd ]] || die "unknown process $1 (known: $(members | tr '\n' ' '))"
  cat "$PIDS/$1.cmd"
}

# launch NAME LOGIN CMD...: runs CMD (the rein binary and its arguments) in a new session, so
# in its own process group, with DATABASE_URL set to the URL of LOGIN (owner, worker or api;
# schedulers use the worker login), its output appended to its log.
launch() {
  local name=$1 role=$2 pid started url
  shift 2
  case $role in
    owner) url=$OWNER_URL ;;
    worker) url=$WORKER_URL ;;
    api) url=$API_URL ;;
    *) die "unknown role $role" ;;
  esac
  printf '%s\n' "$role" "$@" >"$PIDS/$name.cmd"
  printf '=== %s: %s\n' "$(date -u '+%Y-%m-%dT%H:%M:%SZ')" "$*" >>"$LOGS/$name.log"
  DATABASE_URL=$url setsid "$@" </dev/null >>"$LOGS/$name.log" 2>&1 &
  pid=$!
  # The child may not have exec'd yet; its start time is already fixed.
  started=$(start_time "$pid") || {
    wait "$pid" || true
    echo "$pid 0" >"$PIDS/$name.pid"
    return 0
  }
  echo "$pid $started" >"$PIDS/$name.pid"
}

# Re-reads the saved role URLs (written by `up`, mode 600).
load_env() {
  [[ -f $FLEET_DIR/env ]] || die "no fleet in $FLEET_DIR (run: fleet.sh up)"
  # shellcheck source=/dev/null
  source "$FLEET_DIR/env"
}

# The last LINES lines NAME logged since it was last started.
log_tail() {
  awk -v want="$2" '/^=== / { n = 0 } { buf[n++] = $0 }
    END { for (i = (n > want ? n - want : 0); i < n; i++) print buf[i] }' "$LOGS/$1.log"
}

wait_gone() { # NAME DEADLINE_S: waits until NAME is dead or the deadline passes
  local name=$1 deadline=$((SECONDS + $2))
  while live_pid "$name" >/dev/null; do
    ((SECONDS < deadline)) || return 1
    sleep 0.1
  done
}

signal_group() { # NAME SIGNAL
  local pid
  pid=$(live_pid "$1") || return 0
  # The process leads its own group (setsid): signal the group, then the pid in case it
  # changed group.
  kill "-$2" -- "-$pid" 2>/dev/null || true
  kill "-$2" "$pid" 2>/dev/null || true
}

metrics_flag() { # ROLE: prints --metrics-listen if this binary's ROLE has that flag
  if "$BIN" "$1" --help 2>/dev/null | grep -q -- '--metrics-listen'; then
    echo "--metrics-listen"
  fi
}

# --- commands --------------------------------------------------------------------------

cmd_up() {
  local workers=2 i name port mflag_worker mflag_scheduler alive=()
  while (($#)); do
    case $1 in
      --workers)
        [[ ${2:-} =~ ^[0-9]+$ ]] || die "--workers needs a number"
        workers=$2
        shift 2
        ;;
      --workers=*)
        workers=${1#--workers=}
        [[ $workers =~ ^[0-9]+$ ]] || die "--workers needs a number"
        shift
        ;;
      *) die "up: unknown argument $1" ;;
    esac
  done
  command -v setsid >/dev/null || die "setsid is missing (util-linux)"
  OWNER_URL=${REIN_OWNER_DATABASE_URL:-${DATABASE_URL:-}}
  WORKER_URL=${REIN_WORKER_DATABASE_URL:-${DATABASE_URL:-}}
  API_URL=${REIN_API_DATABASE_URL:-${DATABASE_URL:-}}
  if [[ -z $OWNER_URL || -z $WORKER_URL || -z $API_URL ]]; then
    die "set DATABASE_URL to an empty PostgreSQL database, e.g.
  createdb -h 127.0.0.1 -U postgres rein_fleet
  export DATABASE_URL=postgres://postgres@127.0.0.1:5432/rein_fleet
(or run \`rein demo --keep\` and use the DATABASE_URL it prints)"
  fi
  BIN=$(rein_bin)
  mkdir -p "$LOGS" "$PIDS"
  for name in $(members); do
    if live_pid "$name" >/dev/null; then
      die "a fleet is already running in $FLEET_DIR ($name); run: fleet.sh stop"
    fi
  done
  rm -f "$PIDS"/*.pid "$PIDS"/*.cmd
  (
    umask 077
    {
      printf 'BIN=%q\n' "$BIN"
      printf 'OWNER_URL=%q\nWORKER_URL=%q\nAPI_URL=%q\n' "$OWNER_URL" "$WORKER_URL" "$API_URL"
    } >"$FLEET_DIR/env"
  )

  echo "fleet: $BIN ($("$BIN" --version 2>/dev/null || echo unknown version)), state in $FLEET_DIR"
  printf '=== %s: migrate\n' "$(date -u '+%Y-%m-%dT%H:%M:%SZ')" >>"$LOGS/migrate.log"
  if ! DATABASE_URL=$OWNER_URL "$BIN" migrate >>"$LOGS/migrate.log" 2>&1; then
    log_tail migrate 5 >&2
    die "rein migrate failed (log: $LOGS/migrate.log)"
  fi
  echo "fleet: migrated"

  mflag_worker=$(metrics_flag worker)
  mflag_scheduler=$(metrics_flag scheduler)
  [[ -n $mflag_worker ]] || echo "fleet: this rein has no --metrics-listen; starting without metrics"

  launch api api "$BIN" api --listen "$API_LISTEN"
  for i in 0 1; do
    name=scheduler-$([[ $i == 0 ]] && echo a || echo b)
    port=$((SCHEDULER_PORT + i))
    if [[ -n $mflag_scheduler ]]; then
      launch "$name" worker "$BIN" scheduler --id "$name" --metrics-listen "127.0.0.1:$port"
    else
      launch "$name" worker "$BIN" scheduler --id "$name"
    fi
  done
  for ((i = 1; i <= workers; i++)); do
    name=worker-$i
    port=$((WORKER_PORT + i - 1))
    local args=(worker --id "$name" --db-pool-max "$WORKER_POOL" --shutdown-grace-ms "$SHUTDOWN_GRACE_MS")
    [[ -z $mflag_worker ]] || args+=(--metrics-listen "127.0.0.1:$port")
    launch "$name" worker "$BIN" "${args[@]}"
  done

  # Give every process time to connect, check the schema and bind its ports.
  sleep 2
  for name in $(members); do
    if live_pid "$name" >/dev/null; then
      alive+=("$name")
    else
      echo "fleet: $name exited at start; last lines of $LOGS/$name.log:" >&2
      log_tail "$name" 5 | sed 's/^/  /' >&2
      echo "fleet: stopping the others" >&2
      cmd_stop >&2
      exit 1
    fi
  done
  echo "fleet: up: ${alive[*]}"
  echo "fleet: API on http://$API_LISTEN (create a token: rein tokens create --subject you --scope admin)"
  [[ -z $mflag_worker ]] ||
    echo "fleet: metrics on 127.0.0.1:$SCHEDULER_PORT-$((SCHEDULER_PORT + 1)) (schedulers), 127.0.0.1:$WORKER_PORT-$((WORKER_PORT + workers - 1)) (workers)"
}

cmd_status() {
  local name pid state any_dead=0 listen
  if [[ ! -d $PIDS || -z $(members) ]]; then
    echo "fleet: no fleet in $FLEET_DIR"
    return 1
  fi
  printf '%-12s %-8s %-6s %s\n' NAME PID STATE ADDRESS
  for name in $(members); do
    if pid=$(live_pid "$name"); then
      state=alive
    else
      read -r pid _ <"$PIDS/$name.pid" || pid=-
      state=dead
      any_dead=1
    fi
    listen=$(grep -A1 -x -e '--metrics-listen' -e '--listen' "$PIDS/$name.cmd" 2>/dev/null | tail -n 1 || true)
    [[ $listen == --* ]] && listen=
    printf '%-12s %-8s %-6s %s\n' "$name" "$pid" "$state" "${listen:--}"
    if [[ -f $LOGS/$name.log ]] && ((TAIL_LINES > 0)); then
      tail -n "$TAIL_LINES" "$LOGS/$name.log" | cut -c1-160 | sed 's/^/    | /'
    fi
  done
  return "$any_dead"
}

cmd_kill() {
  local name=${1:-} pid
  [[ -n $name ]] || die "kill: which process? ($(members | tr '\n' ' '))"
  command_of "$name" >/dev/null
  pid=$(live_pid "$name") || die "$name is not running"
  signal_group "$name" KILL
  wait_gone "$name" 5 || die "$name (pid $pid) survived SIGKILL for 5 s"
  echo "fleet: killed $name (pid $pid) with SIGKILL"
}

cmd_start() {
  local name=${1:-} role cmd=()
  [[ -n $name ]] || die "start: which process? ($(members | tr '\n' ' '))"
  load_env
  live_pid "$name" >/dev/null && die "$name is already running"
  mapfile -t cmd < <(command_of "$name")
  role=${cmd[0]}
  launch "$name" "$role" "${cmd[@]:1}"
  sleep 1
  live_pid "$name" >/dev/null || {
    log_tail "$name" 5 >&2
    die "$name exited at start"
  }
  echo "fleet: started $name (pid $(live_pid "$name"))"
}

cmd_logs() {
  local name=${1:-}
  [[ -n $name ]] || die "logs: which process? ($(members | tr '\n' ' '))"
  [[ -f $LOGS/$name.log ]] || die "no log for $name"
  exec tail -n 50 -F "$LOGS/$name.log"
}

cmd_stop() {
  local name grace pid left=() pids=() start=$SECONDS
  grace=$((SHUTDOWN_GRACE_MS / 1000 + 5))
  [[ -d $PIDS ]] || {
    echo "fleet: nothing to stop"
    return 0
  }
  for name in $(members); do
    if live_pid "$name" >/dev/null; then
      signal_group "$name" TERM
      left+=("$name")
    fi
  done
  ((${#left[@]})) || echo "fleet: no process was running"
  for name in "${left[@]}"; do
    read -r pid _ <"$PIDS/$name.pid"
    pids+=("$pid")
    if wait_gone "$name" $((grace - (SECONDS - start))); then
      echo "fleet: $name stopped (SIGTERM)"
    else
      signal_group "$name" KILL
      wait_gone "$name" 5 || die "$name survived SIGKILL"
      echo "fleet: $name killed (SIGKILL after ${grace}s)"
    fi
  done
  # Dead processes are reaped by their parent (init, as `up` has exited): give it a moment
  # so that nothing is left, not even a zombie, when this returns.
  for pid in "${pids[@]}"; do
    for _ in {1..20}; do
      [[ -e /proc/$pid ]] || break
      sleep 0.1
    done
  done
  rm -f "$PIDS"/*.pid
  echo "fleet: stopped (logs kept in $LOGS)"
}

main() {
  local sub=${1:-}
  [[ -n $sub ]] || {
    usage
    exit 1
  }
  shift
  case $sub in
    up) cmd_up "$@" ;;
    status) cmd_status ;;
    kill) cmd_kill "$@" ;;
    start) cmd_start "$@" ;;
    logs) cmd_logs "$@" ;;
    stop) cmd_stop ;;
    -h | --help | help) usage ;;
    *)
      usage >&2
      exit 1
      ;;
  esac
}

main "$@"
