"""A real Rein fleet for the tests (see rein_fleet.py): a fresh PostgreSQL database,
`rein migrate`, then `rein api`, `rein worker` and `rein scheduler` as child processes in
their own process groups, stopped in teardown even when a test fails.

The `rein` binary: REIN_BIN, else target/debug/rein of this repository (CARGO_TARGET_DIR
respected). PostgreSQL: REIN_TEST_DATABASE_URL, else DATABASE_URL, else
postgres://postgres@127.0.0.1:5432/postgres; each session creates `rein_py_<random>` in it
(with psql) and drops it afterwards.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

import pytest

import rein
from rein_fleet import (
    DEADLINE_S,
    ROOT,
    Fleet,
    Proc,
    eventually,
    free_port,
    fresh_database,
    rein_binary,
)

# The test modules import the fleet helpers from here.
__all__ = ["DEADLINE_S", "ROOT", "Fleet", "Proc", "eventually", "free_port", "fresh_database",
           "rein_binary", "NodeServer"]

EXAMPLE = ROOT / "examples" / "python"


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
