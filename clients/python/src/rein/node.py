"""Write the nodes of an `http`-action definition as Python functions; serve them as an ASGI
app that speaks Rein's HTTP node protocol (SPEC I2).

    from rein import node

    nodes = node.Nodes()

    @nodes.node("PLANNING")
    def planning(ctx: node.NodeContext) -> node.Reply:
        return node.Event("PLAN_READY", data={"plan": ["refund"]})

    @nodes.tool("refund", side_effect=True)
    def refund(ctx: node.ToolContext, order_id: str, amount: int) -> dict:
        return payments.refund(order_id, amount, idempotency_key=ctx.idempotency_key)

    @nodes.reconcile("refund")
    def refund_applied(ctx: node.ToolContext, order_id: str, amount: int) -> object:
        found = payments.find(ctx.idempotency_key)
        return found if found is not None else node.NOT_APPLIED

    app = nodes.app(journal="nodes.sqlite3")     # an ASGI app: POST /nodes/NAME, /reconcile

What the app does for you:
- parses the run context (`NodeContext`: data, results, the resume brief, idempotency key,
  call id, fencing token) and turns what the function returns into `{"events": [...]}` or
  `{"decision": {...}}`;
- journals every answered call by its idempotency key (a retried call gets the same reply,
  nothing runs twice) and every side-effecting tool call before it runs;
- answers `POST /reconcile` by key: a call it answered is `applied` with the same events; a
  call cut short (the process was killed, the reply lost) is replayed from the journal, its
  side-effecting tools not run again (a tool whose outcome is unknown asks its
  `@reconcile` function), and is `applied` with the events the replay produced, or
  `not applied` when a side effect never happened;
- refuses a call whose fencing token is older than one already seen for the run (409);
- maps `TransientError` to 503 (with `Retry-After`), `FatalError` to 422, any other
  exception to 500 (transient for Rein), per the definition's `transient_event` and
  `fatal_event`;
- honours a cancelled request: when Rein drops the connection, an async node is cancelled
  and a sync node's next side-effecting tool call raises `Cancelled` before it runs.

Plain ASGI, no web framework: the protocol is two POST routes, and a node author never
sees them; any ASGI server runs the app (`serve()` uses uvicorn, `pip install rein-client[serve]`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sqlite3
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Sequence, Union

BODY_BYTES_MAX = 2 * 1024 * 1024
REPLY_EVENTS_MAX = 32
EVENT_TYPE_LEN_MAX = 128
# A reconcile question about a call still being worked on waits this long for it.
RECONCILE_WAIT_S = 30.0

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


# ---- what a node returns ------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """A candidate event: its type (a name of the definition) and payload. `data` is merged
    into the run's business data by the engine (`payload.data`)."""

    type: str
    payload: Mapping[str, Any] | None = None
    data: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        if not isinstance(self.type, str) or not 1 <= len(self.type) <= EVENT_TYPE_LEN_MAX:
            raise FatalError(
                f"an event type is a string of 1..={EVENT_TYPE_LEN_MAX} characters, not {self.type!r}"
            )
        payload = dict(self.payload or {})
        if self.data is not None:
            payload["data"] = dict(self.data)
        out: dict[str, Any] = {"type": self.type}
        if payload:
            out["payload"] = payload
        return out


@dataclass(frozen=True)
class Decision:
    """A model decision for the engine to validate (`{"decision": {...}}`)."""

    decision: Mapping[str, Any]


Reply = Union[Event, str, Decision, Sequence[Union[Event, str]], Mapping[str, Any]]


def reply_json(reply: Any) -> dict[str, Any]:
    """What a node returned, as the protocol's reply body; FatalError when it is not one."""
    if isinstance(reply, Decision):
        return {"decision": dict(reply.decision)}
    if isinstance(reply, Mapping):
        if set(reply) == {"decision"} or set(reply) == {"events"}:
            return reply_json(
                Decision(reply["decision"]) if "decision" in reply else list(reply["events"])
            )
        if "type" in reply:
            return reply_json([reply])
        raise FatalError("a node returned a mapping without `type`, `events` or `decision`")
    items = [reply] if isinstance(reply, (Event, str)) else reply
    if not isinstance(items, Sequence) or not 1 <= len(items) <= REPLY_EVENTS_MAX:
        raise FatalError(
            f"a node returns an Event, an event type, a Decision or 1..={REPLY_EVENTS_MAX} events"
        )
    events = []
    for item in items:
        if isinstance(item, str):
            item = Event(item)
        elif isinstance(item, Mapping):
            item = Event(str(item.get("type", "")), item.get("payload"))
        if not isinstance(item, Event):
            raise FatalError(f"not an event: {item!r}")
        events.append(item.to_json())
    return {"events": events}


# ---- failures -----------------------------------------------------------------------------


class TransientError(Exception):
    """Worth retrying: answered 503 (`Retry-After` when given), which Rein commits as the
    state's `transient_event`."""

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class FatalError(Exception):
    """Retrying cannot help: answered 422, which Rein commits as the state's `fatal_event`."""


class Cancelled(Exception):
    """Rein dropped the call (its timeout passed, the run was cancelled, the worker stopped):
    raised by a side-effecting tool call instead of starting."""


class _NotFinished(Exception):
    """During reconcile: the replay reached a side effect that never happened."""


class _NotAppliedSentinel:
    def __repr__(self) -> str:
        return "NOT_APPLIED"


NOT_APPLIED: Any = _NotAppliedSentinel()
"""What a `@reconcile` function returns when the tool call did not take effect."""


# ---- contexts ------------------------------------------------------------------------------


@dataclass
class ToolContext:
    """What a tool (and its reconcile function) knows about the call it is part of.
    `idempotency_key` is the call's key for its first side-effecting tool call and
    `KEY#N` for the N-th: pass it on to the system the tool changes."""

    tool: str
    idempotency_key: str
    call_key: str
    run_id: str
    call_id: str
    fencing_token: int
    node: str
    seq: int


class NodeContext:
    """The run context of one node call (the request Rein sent) and the call's identity."""

    def __init__(self, request: dict[str, Any], call: _CallState) -> None:
        self.request = request
        self._call = call
        definition = request.get("definition") or {}
        self.definition: str = str(definition.get("name", ""))
        self.definition_version: int = int(definition.get("version", 0))
        self.node: str = str(request.get("node", ""))
        self.state: str = str(request.get("state", ""))
        self.run_id: str = str(request.get("run_id", ""))
        self.step: int = int(request.get("step", 0))
        self.attempt: int = int(request.get("attempt", 0))
        self.action_id: str = str(request.get("action_id", ""))
        self.call_id: str = str(request.get("call_id", ""))
        self.idempotency_key: str = call.key
        self.fencing_token: int = int(request.get("fencing_token", 0))
        data = request.get("data")
        self.data: dict[str, Any] = data if isinstance(data, dict) else {}
        results = request.get("results")
        self.results: list[Any] = results if isinstance(results, list) else []
        self.results_truncated: bool = bool(request.get("results_truncated", False))
        self.brief: Any = request.get("brief")
        resume = request.get("resume")
        self.resume: dict[str, Any] = resume if isinstance(resume, dict) else {}

    @property
    def cancelled(self) -> bool:
        """Whether Rein has dropped this call."""
        return self._call.cancelled.is_set()

    @property
    def reconciling(self) -> bool:
        """Whether this is a replay answering Rein's reconcile question."""
        return self._call.reconciling

    def tool(self, name: str, **args: Any) -> Any:
        """Call a registered tool. A side-effecting one is journaled before it runs and its
        result after, so a replay of this call returns the result without running it."""
        return self._call.run_tool(self, name, args)

    async def atool(self, name: str, **args: Any) -> Any:
        """`tool` from an async node (the tool runs in a thread)."""
        return await asyncio.to_thread(self._call.run_tool, self, name, args)


NodeFn = Callable[[NodeContext], Any]
ToolFn = Callable[..., Any]


@dataclass
class _Tool:
    fn: ToolFn
    side_effect: bool
    reconcile: ToolFn | None = None


class Nodes:
    """A set of nodes and tools; `app()` serves them."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeFn] = {}
        self.tools: dict[str, _Tool] = {}

    def node(self, name: str) -> Callable[[NodeFn], NodeFn]:
        """Register the function answering `POST /nodes/NAME` (the definition's state name)."""
        _check_name(name, "node")

        def register(fn: NodeFn) -> NodeFn:
            if name in self.nodes:
                raise ValueError(f"node {name} is registered twice")
            self.nodes[name] = fn
            return fn

        return register

    def tool(self, name: str, *, side_effect: bool = False) -> Callable[[ToolFn], ToolFn]:
        """Register a tool nodes call with `ctx.tool(name, **args)`. `side_effect=True`:
        it changes something outside (a refund); it runs at most once per key."""
        _check_name(name, "tool")

        def register(fn: ToolFn) -> ToolFn:
            if inspect.iscoroutinefunction(fn):
                raise TypeError(f"tool {name}: tools are plain functions (they run in a thread)")
            old = self.tools.get(name)
            if old is not None and old.fn is not None:
                raise ValueError(f"tool {name} is registered twice")
            self.tools[name] = _Tool(fn, side_effect, old.reconcile if old else None)
            return fn

        return register

    def reconcile(self, tool: str) -> Callable[[ToolFn], ToolFn]:
        """Register how to find out whether a call of `tool` took effect when its outcome is
        unknown: called with the call's ToolContext and arguments, it returns the tool's
        result or `NOT_APPLIED`."""

        def register(fn: ToolFn) -> ToolFn:
            spec = self.tools.get(tool)
            if spec is None:
                raise ValueError(f"@reconcile({tool!r}) needs @tool({tool!r}) registered first")
            spec.reconcile = fn
            return fn

        return register

    def app(self, journal: str | None = None) -> NodeApp:
        """The ASGI app. `journal` is a SQLite file; without one the journal lives in memory
        and a restarted server cannot answer a reconcile question about its earlier calls."""
        return NodeApp(self, Journal(journal or ":memory:"))


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not 1 <= len(name) <= 128 or "/" in name:
        raise ValueError(f"a {what} name is 1..=128 characters without '/', not {name!r}")


# ---- the journal ---------------------------------------------------------------------------


class Journal:
    """Calls answered and side effects started, by idempotency key, in SQLite."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        if path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(
            """
            CREATE TABLE IF NOT EXISTS calls (
                key TEXT PRIMARY KEY, node TEXT NOT NULL, request TEXT NOT NULL,
                reply TEXT, at REAL NOT NULL);
            CREATE TABLE IF NOT EXISTS effects (
                key TEXT NOT NULL, seq INTEGER NOT NULL, tool TEXT NOT NULL,
                args TEXT NOT NULL, state TEXT NOT NULL, result TEXT,
                PRIMARY KEY (key, seq));
            CREATE TABLE IF NOT EXISTS fences (run_id TEXT PRIMARY KEY, token INTEGER NOT NULL);
            """
        )

    def _one(self, sql: str, *args: Any) -> Any:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _exec(self, sql: str, *args: Any) -> None:
        with self._lock:
            self._db.execute(sql, args)

    def fence(self, run_id: str, token: int) -> int | None:
        """Records `token` for the run; the newer token already seen when `token` is older."""
        with self._lock:
            row = self._db.execute("SELECT token FROM fences WHERE run_id = ?", (run_id,)).fetchone()
            if row is not None and row[0] > token:
                return int(row[0])
            self._db.execute(
                "INSERT INTO fences (run_id, token) VALUES (?, ?) "
                "ON CONFLICT (run_id) DO UPDATE SET token = excluded.token",
                (run_id, token),
            )
            return None

    def call(self, key: str) -> tuple[str, dict[str, Any], dict[str, Any] | None] | None:
        row = self._one("SELECT node, request, reply FROM calls WHERE key = ?", key)
        if row is None:
            return None
        return row[0], json.loads(row[1]), json.loads(row[2]) if row[2] else None

    def begin(self, key: str, node: str, request: dict[str, Any]) -> None:
        self._exec(
            "INSERT INTO calls (key, node, request, at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (key) DO UPDATE SET request = excluded.request",
            key, node, json.dumps(request), time.time(),
        )

    def answer(self, key: str, reply: dict[str, Any]) -> None:
        self._exec("UPDATE calls SET reply = ? WHERE key = ?", json.dumps(reply), key)

    def effect(self, key: str, seq: int) -> tuple[str, str, Any] | None:
        row = self._one("SELECT tool, state, result FROM effects WHERE key = ? AND seq = ?", key, seq)
        if row is None:
            return None
        return row[0], row[1], json.loads(row[2]) if row[2] is not None else None

    def start_effect(self, key: str, seq: int, tool: str, args: dict[str, Any]) -> None:
        self._exec(
            "INSERT OR REPLACE INTO effects (key, seq, tool, args, state) VALUES (?, ?, ?, ?, 'started')",
            key, seq, tool, json.dumps(args),
        )

    def finish_effect(self, key: str, seq: int, result: Any) -> None:
        self._exec(
            "UPDATE effects SET state = 'done', result = ? WHERE key = ? AND seq = ?",
            json.dumps(result), key, seq,
        )

    def drop_effect(self, key: str, seq: int) -> None:
        self._exec("DELETE FROM effects WHERE key = ? AND seq = ?", key, seq)

    def effects(self, key: str) -> list[tuple[int, str, str]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, tool, state FROM effects WHERE key = ? ORDER BY seq", (key,)
            ).fetchall()
        return [(int(r[0]), str(r[1]), str(r[2])) for r in rows]


# ---- one call ------------------------------------------------------------------------------


class _CallState:
    def __init__(self, nodes: Nodes, journal: Journal, key: str, reconciling: bool) -> None:
        self.nodes = nodes
        self.journal = journal
        self.key = key
        self.reconciling = reconciling
        self.cancelled = threading.Event()
        self.seq = 0
        self._lock = threading.Lock()

    def run_tool(self, ctx: NodeContext, name: str, args: dict[str, Any]) -> Any:
        spec = self.nodes.tools.get(name)
        if spec is None:
            raise FatalError(f"node {ctx.node} called tool {name!r}, which is not registered")
        if not spec.side_effect:
            tctx = ToolContext(name, self.key, self.key, ctx.run_id, ctx.call_id,
                               ctx.fencing_token, ctx.node, 0)
            return spec.fn(tctx, **args)
        with self._lock:
            self.seq += 1
            seq = self.seq
        key = self.key if seq == 1 else f"{self.key}#{seq}"
        tctx = ToolContext(name, key, self.key, ctx.run_id, ctx.call_id, ctx.fencing_token,
                           ctx.node, seq)
        row = self.journal.effect(self.key, seq)
        if row is not None:
            tool, state, result = row
            if tool != name:
                raise FatalError(
                    f"replaying call {self.key}: side effect #{seq} was {tool}, now {name}; "
                    "a node must call its side-effecting tools in the same order each time"
                )
            if state == "done":
                return result
            # Started and never finished: it may or may not have taken effect.
            if spec.reconcile is None:
                raise FatalError(
                    f"tool {name} (key {key}) may have taken effect and has no @reconcile; "
                    "settle it by hand (`rein resolve`)"
                )
            found = spec.reconcile(tctx, **args)
            if found is not NOT_APPLIED:
                self.journal.finish_effect(self.key, seq, found)
                return found
            self.journal.drop_effect(self.key, seq)
        if self.reconciling:
            raise _NotFinished(f"side effect #{seq} ({name}) never happened")
        if self.cancelled.is_set():
            raise Cancelled(f"call {self.key} was dropped by Rein; {name} was not started")
        self.journal.start_effect(self.key, seq, name, args)
        try:
            result = spec.fn(tctx, **args)
        except BaseException:
            if spec.reconcile is None:
                # Without a way to ask, a tool that raised is taken as not applied.
                self.journal.drop_effect(self.key, seq)
            raise
        self.journal.finish_effect(self.key, seq, result)
        return result


def _error(status: int, message: str) -> tuple[int, dict[str, Any], dict[str, str]]:
    return status, {"error": message}, {}


class NodeApp:
    """The ASGI app of a `Nodes`: `POST /nodes/NAME`, `POST /reconcile`, `GET /healthz`."""

    def __init__(self, nodes: Nodes, journal: Journal) -> None:
        self.nodes = nodes
        self.journal = journal
        self._inflight: dict[str, asyncio.Event] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if method == "GET" and path == "/healthz":
            await _respond(send, 200, {"status": "ok"})
            return
        if method != "POST" or not (path == "/reconcile" or path.startswith("/nodes/")):
            await _respond(send, 404, {"error": f"no route {method} {path}"})
            return
        body = await _read_body(scope, receive)
        if body is _GONE:
            return  # the caller left before its request was whole: nothing to answer
        if body is None:
            await _respond(send, 413, {"error": f"the body is larger than {BODY_BYTES_MAX} bytes"})
            return
        try:
            request = json.loads(body or b"{}")
        except ValueError as e:
            await _respond(send, 400, {"error": f"the body is not JSON: {e}"})
            return
        if not isinstance(request, dict):
            await _respond(send, 400, {"error": "the body must be a JSON object"})
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if path == "/reconcile":
            status, reply, extra = await self._reconcile(request)
            await _respond(send, status, reply, extra)
            return
        disconnected = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, disconnected))
        try:
            status, reply, extra = await self._node(path[len("/nodes/"):], request, headers, disconnected)
        finally:
            watcher.cancel()
        if not disconnected.is_set():
            await _respond(send, status, reply, extra)

    async def _node(
        self, name: str, request: dict[str, Any], headers: dict[str, str], gone: asyncio.Event
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        fn = self.nodes.nodes.get(name)
        if fn is None:
            return _error(404, f"this server has no node {name}")
        key = headers.get("idempotency-key") or str(request.get("idempotency_key") or "")
        if not key:
            return _error(400, "an Idempotency-Key header is required")
        token_text = headers.get("rein-fencing-token") or str(request.get("fencing_token", "0"))
        try:
            token = int(token_text)
        except ValueError:
            return _error(400, f"Rein-Fencing-Token must be an integer, not {token_text[:40]!r}")
        run_id = headers.get("rein-run-id") or str(request.get("run_id", ""))
        newer = await asyncio.to_thread(self.journal.fence, run_id, token)
        if newer is not None:
            return _error(409, f"fenced: run {run_id} was already called with token {newer} > {token}")
        while key in self._inflight:  # the same call twice at once: answer both from one run
            await self._inflight[key].wait()
        done = await asyncio.to_thread(self.journal.call, key)
        if done is not None and done[2] is not None:
            return 200, done[2], {}
        request = {**request, "idempotency_key": key, "fencing_token": token}
        await asyncio.to_thread(self.journal.begin, key, name, request)
        finished = self._inflight[key] = asyncio.Event()
        try:
            return await self._run(fn, request, key, False, gone)
        finally:
            del self._inflight[key]
            finished.set()

    async def _run(
        self, fn: NodeFn, request: dict[str, Any], key: str, reconciling: bool,
        gone: asyncio.Event | None,
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        call = _CallState(self.nodes, self.journal, key, reconciling)
        ctx = NodeContext(request, call)
        if inspect.iscoroutinefunction(fn):
            work: asyncio.Future[Any] = asyncio.ensure_future(fn(ctx))
        else:
            work = asyncio.ensure_future(asyncio.to_thread(fn, ctx))
        if gone is not None:
            stop = asyncio.ensure_future(gone.wait())
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if gone.is_set():
                call.cancelled.set()
                if inspect.iscoroutinefunction(fn):
                    work.cancel()
        try:
            reply = reply_json(await work)
        except asyncio.CancelledError:
            return _error(499, f"call {key} was cancelled by Rein")
        except _NotFinished as e:
            return 200, {"applied": False, "why": str(e)}, {}
        except TransientError as e:
            extra = {"retry-after": str(e.retry_after_s)} if e.retry_after_s is not None else {}
            return 503, {"error": str(e)}, extra
        except (FatalError, Cancelled) as e:
            return _error(422, str(e))
        except Exception as e:  # a bug or an outage in the node: transient for Rein
            traceback.print_exc(file=sys.stderr)
            return _error(500, f"{type(e).__name__}: {e}")
        await asyncio.to_thread(self.journal.answer, key, reply)
        return 200, reply, {}

    async def _reconcile(self, request: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        key = request.get("idempotency_key")
        if not isinstance(key, str) or not key:
            return _error(400, "idempotency_key is required")
        inflight = self._inflight.get(key)
        if inflight is not None:
            try:
                await asyncio.wait_for(inflight.wait(), RECONCILE_WAIT_S)
            except asyncio.TimeoutError:
                return _error(503, f"call {key} is still running; ask again")
        done = await asyncio.to_thread(self.journal.call, key)
        if done is None:
            return 200, {"applied": False}, {}
        name, original, reply = done
        if reply is None:
            fn = self.nodes.nodes.get(name)
            if fn is None:
                return _error(404, f"call {key} was for node {name}, which this server lacks")
            self._inflight[key] = finished = asyncio.Event()
            try:
                status, reply, extra = await self._run(fn, original, key, True, None)
            finally:
                del self._inflight[key]
                finished.set()
            if status != 200 or "applied" in reply:
                # The replay failed or stopped before a side effect: nothing more happened,
                # so the call may be sent again under its key.
                return 200, {"applied": False}, {}
        if "events" not in reply:
            return _error(409, f"call {key} was answered with a decision, which reconcile cannot carry")
        return 200, {"applied": True, "events": reply["events"]}, {}


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


_GONE = b"\0gone"


async def _read_body(scope: Scope, receive: Receive) -> bytes | None:
    """The whole body; None when it is too large; `_GONE` when the caller disconnected."""
    for name, value in scope["headers"]:
        if name.lower() == b"content-length" and value.isdigit() and int(value) > BODY_BYTES_MAX:
            return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return _GONE
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > BODY_BYTES_MAX:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return


async def _respond(send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


def serve(
    app: NodeApp,
    host: str = "127.0.0.1",
    port: int = 8700,
    on_bound: Callable[[str, int], None] | None = None,
) -> None:
    """Runs `app` with uvicorn (`pip install rein-client[serve]`) until interrupted; prints
    `listening on http://HOST:PORT` once it listens (port 0 picks a free one), then calls
    `on_bound(host, port)` (e.g. to register a definition naming the port)."""
    import socket

    try:
        import uvicorn
    except ImportError:
        raise SystemExit("serve() needs uvicorn: pip install 'rein-client[serve]'") from None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=30)
    server = uvicorn.Server(config)
    # Listening before the line is printed: a call that comes before uvicorn runs waits in
    # the backlog instead of being refused.
    sock.listen(2048)
    print(f"listening on http://{bound[0]}:{bound[1]}", flush=True)
    if on_bound is not None:
        on_bound(bound[0], bound[1])
    server.run(sockets=[sock])


# ---- module-level decorators on a default set ------------------------------------------------

default = Nodes()
node = default.node
tool = default.tool
reconcile = default.reconcile


def app(journal: str | None = None) -> NodeApp:
    """The ASGI app of the nodes registered with the module-level decorators."""
    return default.app(journal)
