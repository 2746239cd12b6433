#!/usr/bin/env python3
"""The refund desk's nodes (examples/python/refund-desk.toml) written with the rein.node SDK.

    pip install './clients/python[serve]'
    python examples/python/refund_desk.py --register           # next to `rein worker`

--register registers refund-desk.toml with this server's port through the API (REIN_URL,
REIN_TOKEN with the publish scope) before serving.

Prints `listening on http://HOST:PORT` once it serves. The payment provider is a stand-in:
a SQLite file of refunds (--payments) that records every refund it is asked for, even a
repeated one, so a refund paid twice would show. The SDK's journal (--journal) is what
makes a restarted server answer Rein's reconcile question about a call it was killed in.

Run input: {"order_id": "A1", "amount": 30} and, to watch the in-doubt path, a
"provider_delay_ms" the provider takes to answer after paying (kill the server meanwhile).
"""

from __future__ import annotations

import argparse
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import rein
from rein import node

AMOUNT_MAX = 10_000


class Payments:
    """A payment provider that pays every request it gets (no deduplication of its own)."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS refunds (id INTEGER PRIMARY KEY AUTOINCREMENT,"
            " idempotency_key TEXT NOT NULL, order_id TEXT NOT NULL, amount REAL NOT NULL,"
            " at REAL NOT NULL)"
        )

    def refund(self, key: str, order_id: str, amount: float) -> dict[str, Any]:
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO refunds (idempotency_key, order_id, amount, at) VALUES (?, ?, ?, ?)",
                (key, order_id, amount, time.time()),
            )
        return {"refund_id": cur.lastrowid, "order_id": order_id, "amount": amount}

    def find(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, order_id, amount FROM refunds WHERE idempotency_key = ? ORDER BY id",
                (key,),
            ).fetchone()
        if row is None:
            return None
        return {"refund_id": row[0], "order_id": row[1], "amount": row[2]}


def build(payments: Payments) -> node.Nodes:
    nodes = node.Nodes()

    @nodes.node("INTAKE")
    def intake(ctx: node.NodeContext) -> node.Reply:
        order_id, amount = ctx.data.get("order_id"), ctx.data.get("amount")
        if not isinstance(order_id, str) or not order_id:
            raise node.FatalError("input needs an `order_id` string")
        if not isinstance(amount, (int, float)) or not 0 < amount <= AMOUNT_MAX:
            raise node.FatalError(f"input needs an `amount` in (0, {AMOUNT_MAX}]")
        return "REQUEST_ACCEPTED"

    @nodes.node("REFUNDING")
    def refunding(ctx: node.NodeContext) -> node.Reply:
        receipt = ctx.tool(
            "refund",
            order_id=ctx.data["order_id"],
            amount=ctx.data["amount"],
            delay_ms=int(ctx.data.get("provider_delay_ms", 0)),
        )
        return node.Event("REFUNDED", payload={"result": receipt})

    @nodes.tool("refund", side_effect=True)
    def refund(ctx: node.ToolContext, order_id: str, amount: float, delay_ms: int) -> Any:
        receipt = payments.refund(ctx.idempotency_key, order_id, amount)
        time.sleep(delay_ms / 1000)  # the provider's answer takes this long to come back
        return receipt

    @nodes.reconcile("refund")
    def refund_applied(ctx: node.ToolContext, order_id: str, amount: float, delay_ms: int) -> Any:
        found = payments.find(ctx.idempotency_key)
        return found if found is not None else node.NOT_APPLIED

    @nodes.node("NOTIFYING")
    def notifying(ctx: node.NodeContext) -> node.Reply:
        receipt = ctx.results[-1] if ctx.results else {}
        note = f"order {ctx.data['order_id']}: refunded {ctx.data['amount']} ({receipt})"
        return node.Event("CUSTOMER_NOTIFIED", data={"notice": note})

    return nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8710)
    parser.add_argument("--journal", default="refund-desk-journal.sqlite3")
    parser.add_argument("--payments", default="refund-desk-payments.sqlite3")
    parser.add_argument("--register", action="store_true",
                        help="register refund-desk.toml (with this port) through REIN_URL")
    args = parser.parse_args()
    app = build(Payments(args.payments)).app(journal=args.journal)
    node.serve(app, args.host, args.port, on_bound=register if args.register else None)


def register(host: str, port: int) -> None:
    text = (Path(__file__).parent / "refund-desk.toml").read_text()
    with rein.Client() as client:
        done = client.register_definition(text.replace("{{PORT}}", str(port)), make_current=True)
    print(f"registered {done.name} v{done.version} (created: {done.created})", flush=True)


if __name__ == "__main__":
    main()
