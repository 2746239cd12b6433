#!/usr/bin/env python3
"""An example HTTP node server for Rein's `http` node action (SPEC I2).

Serves the nodes of examples/research-agent-http.toml, standard library only:

    POST /nodes/<NODE>   the node call: run context in, {"events": [...]} out
    POST /reconcile      {"idempotency_key": K} -> {"applied": true, "events": [...]}
                         or {"applied": false}
    GET  /requests       every node and reconcile request received, in order
    GET  /applied        the idempotency keys applied, with how often each was delivered
    POST /control        script the next replies of a node, for tests:
                         {"node": "ACTING", "script": [STEP, ...]} where STEP is one of
                           {"status": 503, "retry_after": "1"}  reply that status, apply nothing
                           {"raw": "text", "status": 200}        reply that body verbatim
                           {"sleep_ms": 1500}                   apply, but only after sleeping
                                                                (longer than Rein's timeout:
                                                                the reply is lost)
                           {"hang_ms": 1500}                    apply nothing and answer nothing
                                                                for that long, then drop the
                                                                connection (a call that always
                                                                times out; reconcile answers
                                                                "not applied")
                         {"reset": true} forgets scripts, requests and applied keys.

A key already applied is answered from memory without acting again, so a retry with the
same Idempotency-Key is harmless. A reconcile question about a key that is still being
worked on waits for that work to finish, then answers.

Usage: node_server.py [--host 127.0.0.1] [--port 0]
Prints `listening on http://HOST:PORT` on stdout once ready (--port 0 picks a free port).
"""

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BODY_MAX = 2 * 1024 * 1024
RECONCILE_WAIT_S = 30


class State:
    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.requests = []
        self.scripts = {}  # node -> [step, ...]
        self.applied = {}  # key -> {"node", "events", "deliveries"}
        self.working = {}  # key -> threading.Event set when the work is done


STATE = State()


def node_events(node, call):
    """What the research agent's nodes answer; None for a node this server lacks."""
    data = call.get("data") or {}
    resume = call.get("resume") or {}
    if node == "INTAKE":
        return [{"type": "TASK_ACCEPTED"}]
    if node == "PLANNING":
        return [{"type": "PLAN_READY", "payload": {"data": {"plan": ["search", "summarise"]}}}]
    if node == "ACTING":
        query = data.get("query", "rein")
        result = {"tool": "search", "step": call.get("step"), "hits": [f"{query} #1", f"{query} #2"]}
        return [{"type": "TOOL_SUCCEEDED", "payload": {"result": result}}]
    if node == "OBSERVING":
        wanted = max(int(data.get("steps", 1)), 1)
        if int(resume.get("steps_completed", 0)) >= wanted:
            # Both candidates: the definition's priority picks TASK_READY.
            return [{"type": "CONTINUE"}, {"type": "TASK_READY"}]
        return [{"type": "CONTINUE"}]
    if node == "FINALIZING":
        count = len(call.get("results") or [])
        return [{"type": "OUTPUT_COMMITTED", "payload": {"data": {"output": f"{count} result(s)"}}}]
    return None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rein-example-node/1"

    def log_message(self, fmt, *args):
        sys.stdout.write("%s %s\n" % (self.address_string(), fmt % args))
        sys.stdout.flush()

    def reply(self, status, body, content_type="application/json", headers=None):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            # The caller gave up (e.g. its timeout passed): the reply is lost.
            self.close_connection = True

    def read_json(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length > BODY_MAX:
            raise ValueError(f"body of {length} bytes is too large")
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw or b"{}")

    def record(self, body):
        entry = {
            "method": self.command,
            "path": self.path,
            "idempotency_key": self.headers.get("Idempotency-Key"),
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": body,
            "at": time.time(),
        }
        with STATE.lock:
            STATE.requests.append(entry)

    def do_GET(self):
        with STATE.lock:
            if self.path == "/requests":
                body = list(STATE.requests)
            elif self.path == "/applied":
                body = {k: {"node": v["node"], "deliveries": v["deliveries"]} for k, v in STATE.applied.items()}
            else:
                body = None
        if body is None:
            self.reply(404, {"error": f"no such path {self.path}"})
        else:
            self.reply(200, body)

    def do_POST(self):
        try:
            body = self.read_json()
        except ValueError as e:
            self.reply(400, {"error": f"bad request body: {e}"})
            return
        if self.path == "/control":
            self.control(body)
        elif self.path == "/reconcile":
            self.record(body)
            self.reconcile(body)
        elif self.path.startswith("/nodes/"):
            self.record(body)
            self.node(self.path[len("/nodes/"):], body)
        else:
            self.reply(404, {"error": f"no such path {self.path}"})

    def control(self, body):
        with STATE.lock:
            if body.get("reset"):
                STATE.reset()
            node = body.get("node")
            if node:
                STATE.scripts.setdefault(node, []).extend(body.get("script") or [])
        self.reply(200, {"ok": True})

    def node(self, node, call):
        key = self.headers.get("Idempotency-Key")
        if not key:
            self.reply(400, {"error": "an Idempotency-Key header is required"})
            return
        with STATE.lock:
            done = STATE.applied.get(key)
            if done is not None:
                done["deliveries"] += 1
                events = done["events"]
                step = None
            else:
                script = STATE.scripts.get(node) or []
                step = script.pop(0) if script else {}
                if "sleep_ms" in step:
                    STATE.working[key] = threading.Event()
        if done is not None:
            self.reply(200, {"events": events})
            return
        if "hang_ms" in step:
            time.sleep(int(step["hang_ms"]) / 1000)
            self.close_connection = True
            return
        if "raw" in step:
            self.reply(int(step.get("status", 200)), str(step["raw"]).encode(), "text/plain")
            return
        status = int(step.get("status", 200))
        if not 200 <= status <= 299:
            headers = {"Retry-After": str(step["retry_after"])} if "retry_after" in step else {}
            self.reply(status, {"error": f"scripted {status}"}, headers=headers)
            return
        events = node_events(node, call)
        if events is None:
            self.reply(404, {"error": f"this server has no node {node}"})
            return
        if "sleep_ms" in step:
            time.sleep(int(step["sleep_ms"]) / 1000)
        with STATE.lock:
            STATE.applied[key] = {"node": node, "events": events, "deliveries": 1}
            working = STATE.working.pop(key, None)
        if working is not None:
            working.set()
        self.reply(200, {"events": events})

    def reconcile(self, body):
        key = body.get("idempotency_key")
        if not isinstance(key, str):
            self.reply(400, {"error": "idempotency_key is required"})
            return
        with STATE.lock:
            working = STATE.working.get(key)
        if working is not None:
            working.wait(RECONCILE_WAIT_S)
        with STATE.lock:
            done = STATE.applied.get(key)
        if done is None:
            self.reply(200, {"applied": False})
        else:
            self.reply(200, {"applied": True, "events": done["events"]})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8700)
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
