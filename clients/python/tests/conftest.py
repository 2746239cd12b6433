"""A real Rein fleet for the tests: a fresh PostgreSQL database, `rein migrate`, then
`rein api`, `rein worker` and `rein scheduler` as child processes, each in its own process
group (and killed with the test process, on Linux), continued and killed in teardown even
when a test fails. Logs go to files under the session's tmp dir, named in failures.

The `rein` binary: REIN_BIN, else target/debug/rein of this repository (CARGO_TARGET_DIR
respected). PostgreSQL: REIN_TEST_DATABASE_URL, else DATABASE_URL, else
postgres://postgres@127.0.0.1:5432/postgres; each session creates `rein_py_<random>` in it
(with psql) and drops it afterwards.
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
from typing import IO, Any, Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

import rein

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "python"
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


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    url, drop = fresh_database()
    fleet = Fleet(tmp_path_factory.mktemp("fleet"), url)
    try:
        fleet.rein("migrate", "--database-url", fleet.database_url)
        _, fleet.api_url = fleet.spawn_rein("api", "api", "--listen", "127.0.0.1:0", first_line=True)
        fleet.spawn_rein("worker", "worker", "--id", "py-worker", "--lease-ttl-ms", "2000",
                         "--poll-interval-ms", "20")
        fleet.spawn_rein("scheduler", "scheduler", "--id", "py-scheduler")
        yield fleet
    finally:
        fleet.stop()
        drop()


ALL_SCOPES = ("read", "enqueue", "operate", "approve", "publish", "admin")


@pytest.fixture(scope="session")
def admin_token(fleet: Fleet) -> str:
    return fleet.token("py-admin", *ALL_SCOPES)


@pytest.fixture()
def client(fleet: Fleet, admin_token: str) -> Iterator[rein.Client]:
    with rein.Client(fleet.api_url, admin_token) as c:
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NodeServer:
    """examples/python/refund_desk.py on a fixed port, restartable with the same journal
    and payment ledger."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.port = free_port()
        self.journal = fleet.tmp / "refund-desk-journal.sqlite3"
        self.payments = fleet.tmp / "refund-desk-payments.sqlite3"
        self.proc: Proc | None = None
        self.starts = 0

    def start(self, register_with: str | None = None) -> None:
        """Starts the server; with a token, it registers its definition through the API."""
        self.starts += 1
        argv = [sys.executable, str(EXAMPLE / "refund_desk.py"), "--port", str(self.port),
                "--journal", str(self.journal), "--payments", str(self.payments)]
        env = {}
        if register_with is not None:
            argv.append("--register")
            env = {"REIN_URL": self.fleet.api_url, "REIN_TOKEN": register_with}
        self.proc, lines = self.fleet.spawn(f"refund-desk-{self.starts}", argv, first_line=True,
                                            env=env, lines=2 if env else 1)
        assert lines.splitlines()[0] == f"listening on http://127.0.0.1:{self.port}", lines
        if env:
            assert lines.splitlines()[1].startswith("registered refund-desk v1"), lines

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def definition(self) -> str:
        text = (EXAMPLE / "refund-desk.toml").read_text()
        return text.replace("{{PORT}}", str(self.port))

    def refunds(self, key: str | None = None) -> list[tuple[Any, ...]]:
        import sqlite3

        if not self.payments.exists():
            return []
        db = sqlite3.connect(self.payments)
        try:
            sql = "SELECT idempotency_key, order_id, amount FROM refunds"
            rows = db.execute(sql + (" WHERE idempotency_key = ?" if key else ""),
                              (key,) if key else ()).fetchall()
        except sqlite3.OperationalError:
            rows = []
        finally:
            db.close()
        return [tuple(r) for r in rows]


@pytest.fixture(scope="session")
def desk(fleet: Fleet, admin_token: str) -> NodeServer:
    server = NodeServer(fleet)
    server.start(register_with=fleet.token("py-publisher", "publish"))
    return server


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
