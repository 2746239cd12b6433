"""The node SDK's protocol handling, driven in-process through its ASGI app (the fleet tests
run it under a real worker)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from rein import node


def make(journal: str | None = None) -> tuple[node.Nodes, dict[str, Any]]:
    nodes = node.Nodes()
    seen: dict[str, Any] = {"calls": 0, "paid": [], "reconciled": [], "known": {}}

    @nodes.node("PAY")
    def pay(ctx: node.NodeContext) -> node.Reply:
        seen["calls"] += 1
        mode = ctx.data.get("mode")
        if mode == "transient":
            raise node.TransientError("provider busy", retry_after_s=3)
        if mode == "fatal":
            raise node.FatalError("no such order")
        if mode == "bug":
            raise KeyError("oops")
        receipt = ctx.tool("pay", amount=ctx.data.get("amount", 1))
        second = ctx.tool("pay", amount=2) if ctx.data.get("twice") else None
        looked = ctx.tool("look", order="A")
        return [node.Event("PAID", payload={"result": receipt, "second": second, "look": looked}),
                "ALSO"]

    @nodes.node("DECIDE")
    async def decide(ctx: node.NodeContext) -> node.Reply:
        return node.Decision({"decision": "FINISH"})

    @nodes.tool("pay", side_effect=True)
    def pay_tool(ctx: node.ToolContext, amount: int) -> dict[str, Any]:
        seen["paid"].append((ctx.idempotency_key, amount))
        return {"paid": amount, "key": ctx.idempotency_key}

    @nodes.reconcile("pay")
    def pay_applied(ctx: node.ToolContext, amount: int) -> Any:
        seen["reconciled"].append(ctx.idempotency_key)
        return seen["known"].get(ctx.idempotency_key, node.NOT_APPLIED)

    @nodes.tool("look")
    def look(ctx: node.ToolContext, order: str) -> str:
        return f"order {order}"

    return nodes, seen


def call(app: node.NodeApp, path: str, body: dict[str, Any], key: str | None = "k1",
         token: int = 1) -> httpx.Response:
    headers = {"Rein-Fencing-Token": str(token), "Rein-Run-Id": "r1", "Rein-Call-Id": "c1"}
    if key is not None:
        headers["Idempotency-Key"] = key

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as c:
            return await c.post(path, json=body, headers=headers)

    return asyncio.run(go())


def context(data: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"run_id": "r1", "node": "PAY", "state": "PAY", "step": 1, "attempt": 0,
            "call_id": "c1", "fencing_token": 1, "data": data or {}, "results": [],
            "definition": {"name": "d", "version": 1}, "resume": {"steps_completed": 0}}


def test_a_call_is_answered_with_events_and_a_retry_gets_the_same_reply_without_running() -> None:
    nodes, seen = make()
    app = nodes.app()
    first = call(app, "/nodes/PAY", context({"amount": 5}))
    assert first.status_code == 200
    events = first.json()["events"]
    assert [e["type"] for e in events] == ["PAID", "ALSO"]
    assert events[0]["payload"]["result"] == {"paid": 5, "key": "k1"}
    assert events[0]["payload"]["look"] == "order A"
    assert "payload" not in events[1]
    again = call(app, "/nodes/PAY", context({"amount": 5}))
    assert again.json() == first.json()
    assert seen["calls"] == 1 and seen["paid"] == [("k1", 5)]


def test_the_nth_side_effect_of_a_call_gets_its_own_key() -> None:
    nodes, seen = make()
    call(nodes.app(), "/nodes/PAY", context({"twice": True}))
    assert seen["paid"] == [("k1", 1), ("k1#2", 2)]


def test_failures_map_to_the_statuses_rein_classifies() -> None:
    nodes, _ = make()
    app = nodes.app()
    busy = call(app, "/nodes/PAY", context({"mode": "transient"}), key="t")
    assert busy.status_code == 503 and busy.headers["retry-after"] == "3"
    assert call(app, "/nodes/PAY", context({"mode": "fatal"}), key="f").status_code == 422
    assert call(app, "/nodes/PAY", context({"mode": "bug"}), key="b").status_code == 500
    # A failed call is not journaled as answered: its retry runs again.
    assert call(app, "/nodes/PAY", context({}), key="t").status_code == 200


def test_protocol_refusals() -> None:
    nodes, seen = make()
    app = nodes.app()
    assert call(app, "/nodes/PAY", context(), key=None).status_code == 400
    assert call(app, "/nodes/NOPE", context()).status_code == 404
    assert call(app, "/nodes/PAY", context(), key="new", token=5).status_code == 200
    stale = call(app, "/nodes/PAY", context(), key="other", token=4)
    assert stale.status_code == 409 and "fenced" in stale.json()["error"]
    assert seen["calls"] == 1


def test_a_decision_reply() -> None:
    nodes, _ = make()
    reply = call(nodes.app(), "/nodes/DECIDE", context())
    assert reply.json() == {"decision": {"decision": "FINISH"}}


def test_reconcile_answers_by_key() -> None:
    nodes, _ = make()
    app = nodes.app()
    assert call(app, "/reconcile", {"idempotency_key": "never"}).json() == {"applied": False}
    answered = call(app, "/nodes/PAY", context()).json()
    assert call(app, "/reconcile", {"idempotency_key": "k1"}).json() == {
        "applied": True, "events": answered["events"]}
    assert call(app, "/reconcile", {}).status_code == 400


def crashed_mid_tool(journal: Path) -> None:
    """The journal a process leaves when it is killed inside the `pay` tool."""
    j = node.Journal(str(journal))
    j.begin("k1", "PAY", {**context({"amount": 9}), "idempotency_key": "k1"})
    j.start_effect("k1", 1, "pay", {"amount": 9})


def test_a_call_cut_short_inside_a_tool_that_took_effect_is_replayed_not_repeated(tmp_path: Path) -> None:
    crashed_mid_tool(tmp_path / "j.sqlite3")
    nodes, seen = make()
    seen["known"]["k1"] = {"paid": 9, "key": "k1", "found": True}
    app = nodes.app(journal=str(tmp_path / "j.sqlite3"))
    got = call(app, "/reconcile", {"idempotency_key": "k1"}).json()
    assert got["applied"] is True
    assert got["events"][0]["payload"]["result"] == {"paid": 9, "key": "k1", "found": True}
    assert seen["paid"] == [] and seen["reconciled"] == ["k1"]
    # A later call with the key is answered from the journal.
    assert call(app, "/nodes/PAY", context({"amount": 9})).json()["events"] == got["events"]
    assert seen["paid"] == []


def test_a_call_cut_short_before_its_side_effect_took_effect_is_not_applied(tmp_path: Path) -> None:
    crashed_mid_tool(tmp_path / "j.sqlite3")
    nodes, seen = make()
    app = nodes.app(journal=str(tmp_path / "j.sqlite3"))
    assert call(app, "/reconcile", {"idempotency_key": "k1"}).json() == {"applied": False}
    # Rein sends the call again under its key: now the refund runs, once.
    again = call(app, "/nodes/PAY", context({"amount": 9}))
    assert again.status_code == 200
    assert seen["paid"] == [("k1", 9)]


def test_replies_are_checked_before_they_are_sent() -> None:
    assert node.reply_json("A") == {"events": [{"type": "A"}]}
    assert node.reply_json({"type": "A", "payload": {"x": 1}}) == {
        "events": [{"type": "A", "payload": {"x": 1}}]}
    assert node.reply_json(node.Event("A", data={"k": 1})) == {
        "events": [{"type": "A", "payload": {"data": {"k": 1}}}]}
    for bad in ([], ["A"] * 33, node.Event(""), {"nope": 1}, 3):
        with pytest.raises(node.FatalError):
            node.reply_json(bad)


def test_a_cancelled_call_does_not_start_its_side_effect() -> None:
    nodes = node.Nodes()
    ran: list[str] = []

    @nodes.node("SLOW")
    def slow(ctx: node.NodeContext) -> node.Reply:
        ctx._call.cancelled.set()  # as the app does when Rein drops the connection
        ctx.tool("act")
        return "DONE"

    @nodes.tool("act", side_effect=True)
    def act(ctx: node.ToolContext) -> None:
        ran.append(ctx.idempotency_key)

    reply = call(nodes.app(), "/nodes/SLOW", context())
    assert reply.status_code == 422 and "was not started" in reply.json()["error"]
    assert ran == []


def test_a_call_rein_drops_is_cancelled_under_a_real_server() -> None:
    """Served by uvicorn: when the caller gives up, an async node is cancelled and a sync
    node's next side-effecting tool call does not start."""
    import socket
    import threading
    import time

    import uvicorn

    nodes = node.Nodes()
    seen: list[str] = []
    started = threading.Event()

    @nodes.node("ASYNC")
    async def slow_async(ctx: node.NodeContext) -> node.Reply:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("async cancelled")
            raise
        return "LATE"

    @nodes.node("SYNC")
    def slow_sync(ctx: node.NodeContext) -> node.Reply:
        started.set()
        deadline = time.monotonic() + 60
        while not ctx.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            ctx.tool("act")
        except node.Cancelled:
            seen.append("sync tool not started")
            raise
        return "LATE"

    @nodes.tool("act", side_effect=True)
    def act(ctx: node.ToolContext) -> None:
        seen.append("act ran")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(nodes.app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        up_by = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < up_by, "the node server did not start within 30 s"
            time.sleep(0.01)
        for name, wanted in (("ASYNC", "async cancelled"), ("SYNC", "sync tool not started")):
            started.clear()
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"http://127.0.0.1:{port}/nodes/{name}", json=context(),
                           headers={"Idempotency-Key": name}, timeout=httpx.Timeout(5, read=0.5))
            assert started.is_set()
            deadline = time.monotonic() + 30
            while wanted not in seen and time.monotonic() < deadline:
                time.sleep(0.01)
            assert wanted in seen, seen
        assert "act ran" not in seen
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_module_level_decorators_fill_the_default_set() -> None:
    name = "MODULE_LEVEL_NODE"

    @node.node(name)
    def answer(ctx: node.NodeContext) -> node.Reply:
        return node.Event("OK", payload={"key": ctx.idempotency_key, "run": ctx.run_id})

    try:
        reply = call(node.app(), f"/nodes/{name}", context(), key="mk")
        assert reply.json() == {"events": [{"type": "OK", "payload": {"key": "mk", "run": "r1"}}]}
        with pytest.raises(ValueError, match="twice"):
            node.node(name)(answer)
    finally:
        del node.default.nodes[name]
