"""A real Rein fleet as child processes: a fresh PostgreSQL database, `rein migrate`, then
`rein api`, `rein worker` and `rein scheduler`, each in its own process group (and killed
with the test process, on Linux), continued and killed by `Fleet.stop` even when a test
fails. Logs go to files under the fleet's tmp dir, named in failures. The Python client's
tests and the console's browser tests (tests/console) both start theirs with it.

The `rein` binary: REIN_BIN, else target/debug/rein of this repository (CARGO_TARGET_DIR
respected). PostgreSQL: REIN_TEST_DATABASE_URL, else DATABASE_URL, else
postgres://postgres@127.0.0.1:5432/postgres; `fresh_database` creates `rein_py_<random>` in
it (with psql) and returns what drops it.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[3]
DEADLINE_S = 60.0


def rein_binary() -> Path:
    if os.environ.get("REIN_BIN"):
        return Path(os.environ["REIN_BIN"])
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    return target / "debug" / "rein"


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Proc:
    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.name, self.popen, self.log = name, popen, log

    def kill(self) -> None:
        """SIGCONT then SIGKILL to the whole group, and reap."""
        if self.popen.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(self.popen.pid, sig)
                except ProcessLookupError:
                    pass
        self.popen.wait(timeout=30)

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {self.log})"
        return "\n".join(text)


class Fleet:
    def __init__(self, tmp: Path, database_url: str) -> None:
        self.tmp = tmp
        self.database_url = database_url
        self.binary = rein_binary()
        self.procs: list[Proc] = []
        self.api_url = ""

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("DATABASE_URL", "REIN_URL", "REIN_TOKEN", "REDIS_URL")}
        env["REIN_LOG"] = "info,sqlx=warn"
        # Redaction markers are keyed: a test fleet's key, a deployment's own secret.
        env["REIN_REDACTION_KEY"] = "test-fleet-redaction-key-" + "0" * 32
        return env

    def rein(self, *args: str) -> str:
        done = subprocess.run([str(self.binary), *args], env=self.env(), capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise AssertionError(f"rein {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
        return done.stdout

    def spawn(self, name: str, argv: list[str], first_line: bool = False,
              env: dict[str, str] | None = None, lines: int = 1) -> tuple[Proc, str]:
        """Starts `argv` in its own process group, stderr (and stdout) to NAME.log; with
        `first_line`, returns the first `lines` lines it prints on stdout."""
        log = self.tmp / f"{name}.log"
        out: IO[bytes] = open(log, "ab")
        popen = subprocess.Popen(
            argv, env={**self.env(), **(env or {})}, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if first_line else out, stderr=out,
            start_new_session=True, preexec_fn=_die_with_parent,
        )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        line = ""
        if first_line:
            assert popen.stdout is not None
            line = "\n".join(popen.stdout.readline().decode().strip() for _ in range(lines))
            if not line.strip():
                popen.wait(timeout=10)
                raise AssertionError(f"{name} printed nothing and exited; its log:\n{proc.tail()}")
            stdout = popen.stdout

            def drain() -> None:
                for chunk in iter(lambda: stdout.read(4096), b""):
                    out.write(chunk)
                    out.flush()

            threading.Thread(target=drain, daemon=True).start()
        return proc, line

    def spawn_rein(self, name: str, *args: str, first_line: bool = False) -> tuple[Proc, str]:
        return self.spawn(name, [str(self.binary), *args, "--database-url", self.database_url],
                          first_line)

    def token(self, subject: str, *scopes: str) -> str:
        args = ["tokens", "create", "--database-url", self.database_url, "--subject", subject]
        for scope in scopes:
            args += ["--scope", scope]
        return self.rein(*args).strip()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.kill()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ({p.log}):\n{p.tail()}" for p in self.procs)


def _psql(base_url: str, sql: str) -> None:
    psql = shutil.which("psql")
    if psql is None:
        raise RuntimeError("psql is not on PATH (Debian: apt-get install postgresql-client)")
    subprocess.run([psql, base_url, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-c", sql],
                   check=True, capture_output=True, timeout=60)


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def fresh_database() -> tuple[str, Callable[[], None]]:
    """A new, empty database's URL, and what drops it."""
    binary = rein_binary()
    if not binary.is_file():
        raise RuntimeError(f"no rein binary at {binary}: run `cargo build --bin rein` or set REIN_BIN")
    base = (os.environ.get("REIN_TEST_DATABASE_URL") or os.environ.get("DATABASE_URL")
            or "postgres://postgres@127.0.0.1:5432/postgres")
    name = f"rein_py_{secrets.token_hex(6)}"
    _psql(base, f"CREATE DATABASE {name}")

    def drop() -> None:
        try:
            _psql(base, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        except subprocess.CalledProcessError:
            pass

    return _with_database(base, name), drop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def eventually(what: str, probe: Callable[[], Any], fleet: Fleet | None = None) -> Any:
    """probe() until it returns something truthy, at most DEADLINE_S."""
    until = time.monotonic() + DEADLINE_S
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > until:
            logs = fleet.logs() if fleet else ""
            raise AssertionError(f"timed out after {DEADLINE_S}s waiting for {what}\n{logs}")
        time.sleep(0.05)
