"""The web console (`rein api` at /) in Chromium: signing in, finding runs, a run's timeline
and state diagram, deciding approvals, scopes, the fleet, small screens, the keyboard."""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import os
import re
import threading
from typing import Any

from playwright.sync_api import expect

from conftest import ADMIN, PHONE, ROOT, ConsoleFleet, Pages, after_route, go, shot, sign_in, wait_until

CONSOLE = ROOT / "crates" / "api" / "console"
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def lifecycle(fleet: ConsoleFleet, steps: int = 2) -> str:
    return fleet.enqueue("lifecycle", {"sim": {"work_ms": 5, "steps": steps}})


def test_the_console_is_served_at_the_root_with_a_strict_policy(fleet: ConsoleFleet) -> None:
    root = fleet.call("GET", "/", token="")
    assert root.status_code == 200, root.text
    assert root.headers["content-type"].startswith("text/html")
    assert root.headers["content-security-policy"] == CSP
    assert root.content == (CONSOLE / "index.html").read_bytes(), (
        f"{fleet.binary} serves another console than {CONSOLE}: rebuild it "
        "(or set REIN_CONSOLE_DIR to serve the directory)")
    for path in sorted(CONSOLE.iterdir()):
        if path.name == "index.html":
            continue
        got = fleet.call("GET", f"/console/{path.name}", token="")
        assert got.status_code == 200, (path.name, got.status_code)
        assert got.content == path.read_bytes(), f"/console/{path.name} is not {path}"
    assert fleet.call("GET", "/console/no-such-file.js", token="").status_code == 404
    total = sum(p.stat().st_size for p in CONSOLE.iterdir())
    assert total < 150_000, f"the console is {total} bytes"
    # Nothing in the markup that the policy would refuse.
    for path in CONSOLE.iterdir():
        text = path.read_text()
        assert not re.search(r"\sstyle=|\son[a-z]+=|innerHTML|<script>", text), path.name


def test_signing_in_shows_the_subject_and_keeps_the_token_in_memory_only(pages: Pages, fleet: ConsoleFleet) -> None:
    page = pages.open()
    expect(page.locator("label[for=token]")).to_have_text("API token")
    assert page.get_attribute("#token", "type") == "password"
    shot(page, "signin")
    sign_in(page, fleet.admin_token)
    expect(page.locator("#whoami")).to_have_text(ADMIN)
    expect(page.locator(".scopes")).to_contain_text("admin")
    assert page.url.endswith("#/runs")
    assert fleet.admin_token not in page.url
    stored = page.evaluate("() => [localStorage.length, sessionStorage.length, document.cookie]")
    assert stored == [0, 0, ""], stored
    # A reload forgets it.
    page.reload()
    page.wait_for_selector("#token")
    expect(page.locator("#whoami")).to_have_count(0)


def test_a_wrong_token_is_refused_with_the_servers_reason(pages: Pages) -> None:
    page = pages.open()
    page.fill("#token", "rein_not-a-real-token")
    page.click("button[type=submit]")
    error = page.locator("#signin-error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("not accepted")
    expect(page.locator("#whoami")).to_have_count(0)
    shot(page, "signin-refused")


def test_keyboard_only_sign_in(pages: Pages, fleet: ConsoleFleet) -> None:
    page = pages.open()
    assert page.evaluate("() => document.activeElement.id") == "token"
    page.keyboard.type(fleet.admin_token)
    page.keyboard.press("Enter")
    expect(page.locator("#whoami")).to_have_text(ADMIN)
    # Focus starts on the page; the sections are a few Shift+Tabs back, and Enter follows
    # a link.
    assert page.evaluate("() => document.activeElement.id") == "main"
    for _ in range(10):
        page.keyboard.press("Shift+Tab")
        if page.evaluate("() => document.activeElement.textContent") == "Fleet":
            break
    page.keyboard.press("Enter")
    expect(page.locator("h1")).to_have_text("Fleet")


def test_a_revoked_token_returns_to_sign_in_with_a_message(pages: Pages, fleet: ConsoleFleet) -> None:
    token = fleet.token("console-short-lived", "read")
    me = fleet.json("GET", "/v1/me", token=token)
    page = pages.signed_in(token)
    fleet.rein("tokens", "revoke", "--database-url", fleet.database_url, me["token_id"])
    # The runs page refreshes every 2 s; the next answer is a 401.
    page.wait_for_selector("#token", timeout=60_000)
    expect(page.locator("#signin-error")).to_contain_text("Signed out")


def test_finding_a_run_by_id_by_prefix_and_by_filters(pages: Pages, fleet: ConsoleFleet) -> None:
    done = lifecycle(fleet)
    parked = fleet.refund(250, "F1")
    fleet.approval_of(parked)
    fleet.finished(done)
    page = pages.signed_in()
    expect(page.locator(f"tr[data-run-id='{parked}']")).to_be_visible()
    row = page.locator(f"tr[data-run-id='{parked}']")
    expect(row).to_contain_text("refund-agent@")
    expect(row).to_contain_text("WAITING_APPROVAL")
    expect(row).to_contain_text("parked")
    expect(row.locator("a")).to_have_text(f"{parked[:8]}…{parked[-4:]}")
    shot(page, "runs")

    # A full id opens the run.
    page.fill("#f-q", done)
    after_route(page, lambda: page.press("#f-q", "Enter"))
    assert page.url.endswith(f"#/runs/{done}")
    expect(page.locator("#run-state")).to_have_text(fleet.run(done)["state"])

    # A prefix filters.
    go(page, "#/runs")
    page.fill("#f-q", parked[:7])
    after_route(page, lambda: page.press("#f-q", "Enter"))
    assert f"q={parked[:7]}" in page.url
    ids = wait_until("the prefix filter", lambda: (
        got := page.eval_on_selector_all("tr[data-run-id]", "rows => rows.map(r => r.dataset.runId)")
    ) and all(i.startswith(parked[:7]) for i in got) and got)
    assert parked in ids
    # So does a short id as the table shows it.
    go(page, "#/runs")
    page.fill("#f-q", f"{parked[:8]}…{parked[-4:]}")
    after_route(page, lambda: page.press("#f-q", "Enter"))
    expect(page.locator("tr[data-run-id]")).to_have_count(1)
    expect(page.locator(f"tr[data-run-id='{parked}']")).to_be_visible()

    # Filters: parked refund-agent runs include the parked one and not the finished one.
    go(page, "#/runs")
    page.fill("#f-definition", "refund-agent")
    after_route(page, lambda: page.select_option("#f-status", "parked"))
    assert "status=parked" in page.url and "definition=refund-agent" in page.url
    expect(page.locator(f"tr[data-run-id='{parked}']")).to_be_visible()
    expect(page.locator(f"tr[data-run-id='{done}']")).to_have_count(0)
    statuses = page.eval_on_selector_all("tr[data-run-id] td:nth-child(2)", "c => c.map(x => x.textContent)")
    assert statuses and set(statuses) == {"parked"}, statuses
    page.fill("#f-state", "WAITING_APPROVAL")
    after_route(page, lambda: page.press("#f-state", "Enter"))
    expect(page.locator(f"tr[data-run-id='{parked}']")).to_be_visible()
    page.fill("#f-state", "DONE")
    after_route(page, lambda: page.press("#f-state", "Enter"))
    expect(page.locator("#runs-body")).to_have_attribute("aria-busy", "false")
    expect(page.locator(f"tr[data-run-id='{parked}']")).to_have_count(0)

    # An id that names no run says so.
    page.fill("#f-q", "00000000-0000-4000-8000-000000000000")
    page.press("#f-q", "Enter")
    expect(page.locator("#alerts .alert")).to_contain_text("No run 00000000-0000-4000-8000-000000000000")
    fleet.call("POST", f"/v1/runs/{parked}/events", json={"type": "CANCEL", "payload": {}})


def test_the_runs_page_pages_through_cursors(pages: Pages, fleet: ConsoleFleet) -> None:
    for _ in range(52):
        fleet.enqueue("lifecycle", {"sim": {"work_ms": 1}}, queue="paging")
    page = pages.signed_in(hash="#/runs?queue=paging")
    expect(page.locator("tr[data-run-id]")).to_have_count(50)
    first = page.eval_on_selector_all("tr[data-run-id]", "r => r.map(x => x.dataset.runId)")
    page.click("text=Next page")
    expect(page.locator("tr[data-run-id]")).to_have_count(2)
    second = page.eval_on_selector_all("tr[data-run-id]", "r => r.map(x => x.dataset.runId)")
    assert not set(first) & set(second)
    expect(page.get_by_role("button", name="Next page")).to_be_disabled()
    page.click("text=Newer")
    expect(page.locator("tr[data-run-id]")).to_have_count(50)
    expect(page.locator("#runs-updated")).to_contain_text("updated")


def test_a_run_page_shows_the_timeline_in_order_and_the_current_state(pages: Pages, fleet: ConsoleFleet) -> None:
    run_id = lifecycle(fleet, steps=3)
    run = fleet.finished(run_id)
    events = fleet.events(run_id)
    page = pages.signed_in(hash=f"#/runs/{run_id}")
    rows = page.locator("#timeline tbody tr")
    expect(rows).to_have_count(len(events))
    got = page.eval_on_selector_all("#timeline tbody tr", "r => r.map(x => [Number(x.dataset.sequence), x.dataset.type])")
    assert got == [[e["sequence"], e["type"]] for e in events]
    assert [g[0] for g in got] == list(range(1, len(events) + 1))
    # The payload opens.
    with_payload = page.locator("#timeline details").first
    with_payload.locator("summary").click()
    expect(with_payload.locator("pre")).to_be_visible()
    # The diagram marks the current state, and only it.
    current = page.locator("#diagram g.state.current")
    expect(current).to_have_count(1)
    assert current.get_attribute("data-state") == run["state"]
    visited = page.eval_on_selector_all("#diagram g.state.visited", "g => g.map(x => x.dataset.state)")
    assert run["state"] in visited and len(visited) >= 2
    assert page.locator("#diagram path.edge.taken").count() >= 1
    expect(page.locator("#diagram-current")).to_have_text(run["state"])
    expect(page.locator("#stream-state")).to_have_text("run ended")


def test_approving_a_refund_from_the_inbox_moves_the_run_on(pages: Pages, fleet: ConsoleFleet) -> None:
    other = fleet.refund(180, "A0")
    run_id = fleet.refund(420, "A1")
    approval = fleet.approval_of(run_id)
    fleet.approval_of(other)
    assert fleet.run(run_id)["state"] == "WAITING_APPROVAL"

    # The run page while it waits: the diagram has it in WAITING_APPROVAL, live.
    run_page = pages.signed_in(hash=f"#/runs/{run_id}")
    expect(run_page.locator("#diagram g.state.current")).to_have_attribute("data-state", "WAITING_APPROVAL")
    expect(run_page.locator("#stream-state")).to_have_text("● live")
    before = run_page.locator("#timeline tbody tr").count()

    page = pages.signed_in(hash="#/approvals")
    card = page.locator(f"article[data-approval-id='{approval['approval_id']}']")
    expect(card).to_be_visible()
    expect(card).to_contain_text("refund")
    expect(card.locator("pre")).to_contain_text('"amount": 420')
    expect(card).to_contain_text(approval["action_hash"][:16])
    expect(card).to_contain_text("in 59 min")
    shot(page, "approvals")
    card.locator("textarea").fill("checked the order by phone")
    card.get_by_role("button", name="Approve").click()
    expect(card.locator(".decided-by")).to_have_text(ADMIN)
    expect(card.locator(".badge-ap-granted")).to_have_text("granted")
    expect(card.locator(".decided-comment")).to_have_text("checked the order by phone")
    expect(card.locator(".run-now a")).to_have_attribute("data-state", "DONE", timeout=30_000)
    shot(page, "approvals-decided")

    decided = fleet.json("GET", "/v1/approvals", params={"run": run_id, "all": "true"})[0]
    assert decided["status"] == "granted" and decided["decided_by"] == ADMIN
    assert decided["comment"] == "checked the order by phone"
    assert fleet.finished(run_id)["state"] == "DONE"

    # The run page followed it without a reload: new events, the current state moved.
    expect(run_page.locator("#timeline tr[data-type='APPROVED']")).to_have_count(1)
    assert run_page.locator("#timeline tbody tr").count() > before
    expect(run_page.locator("#diagram g.state.current")).to_have_attribute("data-state", "DONE")
    expect(run_page.locator("#run-state")).to_have_text("DONE")
    shot(run_page, "run-refund")
    fleet.call("POST", f"/v1/runs/{other}/events", json={"type": "CANCEL", "payload": {}})


def test_a_read_only_token_sees_no_decision_buttons_and_the_api_refuses_it(pages: Pages, fleet: ConsoleFleet) -> None:
    run_id = fleet.refund(300, "R1")
    approval = fleet.approval_of(run_id)
    page = pages.signed_in(fleet.reader_token, hash="#/approvals")
    expect(page.locator("#whoami")).to_have_text("console-reader")
    card = page.locator(f"article[data-approval-id='{approval['approval_id']}']")
    expect(card).to_be_visible()
    expect(page.locator("#read-only-note")).to_be_visible()
    expect(card.get_by_role("button", name="Approve")).to_have_count(0)
    expect(card.get_by_role("button", name="Deny")).to_have_count(0)
    expect(page.get_by_role("link", name="Notifications")).to_have_count(0)
    shot(page, "approvals-read-only")
    refused = fleet.call("POST", f"/v1/approvals/{approval['approval_id']}/grant", token=fleet.reader_token, json={})
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "forbidden"
    # No operator actions on the run page either.
    go(page, f"#/runs/{run_id}")
    expect(page.locator("#run-state")).to_have_text("WAITING_APPROVAL")
    expect(page.locator("#cancel-run")).to_have_count(0)
    expect(page.locator(".run-actions")).to_contain_text("need the operate scope")
    assert fleet.call("POST", f"/v1/runs/{run_id}/events", token=fleet.reader_token,
                      json={"type": "CANCEL", "payload": {}}).status_code == 403
    fleet.call("POST", f"/v1/runs/{run_id}/events", json={"type": "CANCEL", "payload": {}})


def test_a_stale_decision_shows_the_refusal_and_its_reason(pages: Pages, fleet: ConsoleFleet) -> None:
    run_id = fleet.refund(510, "S1")
    approval = fleet.approval_of(run_id)
    selector = f"article[data-approval-id='{approval['approval_id']}']"
    first = pages.signed_in(hash="#/approvals")
    second = pages.signed_in(hash="#/approvals")
    expect(second.locator(selector)).to_be_visible()
    first.locator(selector).get_by_role("button", name="Deny").click()
    expect(first.locator(selector).locator(".decided-by")).to_have_text(ADMIN)
    # The second page still shows the request open; deciding it now is refused.
    card = second.locator(selector)
    card.get_by_role("button", name="Approve").click()
    refusal = card.locator(".refusal")
    expect(refusal).to_be_visible()
    again = fleet.call("POST", f"/v1/approvals/{approval['approval_id']}/grant", json={})
    assert again.status_code == 409, again.text
    error = again.json()["error"]
    expect(refusal).to_have_attribute("data-code", error["code"])
    expect(refusal.locator(".reason")).to_have_text(error["message"])
    expect(card.locator(".badge-ap-denied")).to_have_text("denied")
    shot(second, "approvals-refused")
    assert fleet.finished(run_id)["state"] == "DENIED"


def test_cancelling_from_the_run_page_asks_first(pages: Pages, fleet: ConsoleFleet) -> None:
    run_id = fleet.refund(700, "C1")
    fleet.approval_of(run_id)
    page = pages.signed_in(hash=f"#/runs/{run_id}")
    page.click("#cancel-run")
    dialog = page.locator("dialog")
    expect(dialog).to_be_visible()
    shot(page, "run-cancel-dialog")
    dialog.get_by_role("button", name="Back").click()
    expect(dialog).to_have_count(0)
    assert fleet.run(run_id)["status"] == "parked"
    page.click("#cancel-run")
    page.fill("#cancel-reason", "customer withdrew")
    page.locator("dialog").get_by_role("button", name="Cancel the run").click()
    expect(page.locator("#run-state")).to_have_text("CANCELLED")
    cancel = [e for e in fleet.events(run_id) if e["type"] == "CANCEL"]
    assert len(cancel) == 1 and cancel[0]["payload"] == {"reason": "customer withdrew"}
    expect(page.locator("#timeline tr[data-type='CANCEL'] td.by")).to_contain_text(ADMIN)
    # A finished run can be rerun; the new run links back to it as its parent, and the
    # first lists it among its branches.
    page.click("#rerun-run")
    after_route(page, lambda: page.locator("dialog").get_by_role("button", name="Rerun").click())
    again = page.url.rsplit("/", 1)[-1]
    assert again != run_id and fleet.run(again)["parent_run_id"] == run_id
    expect(page.locator(f"#sec-branches ~ * a[href='#/runs/{run_id}']")).to_be_visible()
    go(page, f"#/runs/{run_id}")
    expect(page.locator(f"#sec-branches ~ * a[href='#/runs/{again}']")).to_be_visible()
    fleet.call("POST", f"/v1/runs/{again}/events", json={"type": "CANCEL", "payload": {}})


def test_the_fleet_page_lists_the_worker_and_the_scheduler(pages: Pages) -> None:
    page = pages.signed_in(hash="#/fleet")
    worker = page.locator("tr[data-worker-id='console-worker']")
    scheduler = page.locator("tr[data-worker-id='console-scheduler']")
    expect(worker).to_be_visible()
    expect(scheduler).to_be_visible()
    assert worker.get_attribute("data-role") == "worker"
    assert scheduler.get_attribute("data-role") == "scheduler"
    expect(scheduler).to_contain_text("leader", timeout=30_000)
    expect(worker).to_contain_text("silent for")
    shot(page, "fleet")


LONG_RUN = """
name = "console-long-run"
version = 1
max_events = 1300
cancel_state = "STOPPED"
events = ["next"]

[[states]]
name = "LOOP"
kind = "active"
initial = true
action = "noop"

[[states]]
name = "STOPPED"
kind = "terminal"

[[transitions]]
from = "LOOP"
event = "next"
to = "LOOP"
"""


def test_a_long_run_opens_on_its_newest_events_and_loads_earlier_ones(pages: Pages, fleet: ConsoleFleet) -> None:
    registered = fleet.call("POST", "/v1/definitions", content=LONG_RUN,
                            headers={"content-type": "application/toml"})
    assert registered.status_code in (200, 201), registered.text
    run = fleet.enqueue("console-long-run", {})
    final = fleet.finished(run)
    total = final["sequence"]
    assert total >= 1300, final
    page = pages.signed_in(hash=f"#/runs/{run}")
    rows = page.locator("#timeline tbody tr")
    expect(rows).to_have_count(1000, timeout=30_000)
    first = total - 1000 + 1
    expect(rows.first).to_have_attribute("data-sequence", str(first))
    expect(rows.last).to_have_attribute("data-sequence", str(total))
    hidden = first - 1
    expect(page.locator("#timeline-earlier-box")).to_contain_text(f"{hidden} earlier events are not shown")
    page.click("#timeline-earlier")
    expect(rows).to_have_count(total, timeout=30_000)
    expect(rows.first).to_have_attribute("data-sequence", "1")
    expect(page.locator("#timeline-earlier")).to_have_count(0)
    sequences = [int(s) for s in rows.evaluate_all("rs => rs.map(r => r.dataset.sequence)")]
    assert sequences == list(range(1, total + 1))


class Receiver:
    """A webhook receiver on loopback: answers 200 on /ok and 500 on /down, and counts."""

    def __init__(self) -> None:
        seen: list[tuple[str, str]] = []
        bodies: list[tuple[dict[str, str], bytes]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                seen.append((self.path, self.headers.get("Rein-Delivery-Id", "")))
                bodies.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(200 if self.path == "/ok" else 500)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.seen = seen
        self.bodies = bodies
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


WEBHOOK_SECRET = "a-secret-of-at-least-16-bytes"


def add_webhook(fleet: ConsoleFleet, url: str, kinds: tuple[str, ...] = ("run.finished", "run.failed"),
                definition: str = "lifecycle") -> str:
    os.environ["CONSOLE_WEBHOOK_SECRET"] = WEBHOOK_SECRET
    args = ["webhooks", "add", "--database-url", fleet.database_url, "--url", url,
            "--secret-env", "CONSOLE_WEBHOOK_SECRET", "--definition", definition]
    for kind in kinds:
        args += ["--kind", kind]
    return fleet.rein(*args).strip()


def test_an_approver_is_told_of_a_refund_by_webhook_and_the_decision_in_the_console_is_announced(
        pages: Pages, fleet: ConsoleFleet) -> None:
    receiver = Receiver()
    hook = add_webhook(fleet, f"{receiver.url}/ok", ("approval.requested", "approval.decided"),
                       "refund-agent")
    try:
        run_id = fleet.refund(333, "W1")
        approval = fleet.approval_of(run_id)

        def announced(kind: str) -> dict[str, Any] | None:
            for headers, body in receiver.bodies:
                doc = json.loads(body)
                if doc["kind"] == kind and doc["run_id"] == run_id:
                    mac = hmac.new(WEBHOOK_SECRET.encode(), f"{headers['rein-timestamp']}.".encode() + body,
                                   hashlib.sha256).hexdigest()
                    assert headers["rein-signature"] == f"v1={mac}", headers
                    assert headers["rein-delivery-id"] == doc["id"]
                    return doc
            return None

        asked = wait_until("the approval request announced", lambda: announced("approval.requested"))
        assert asked["approval"]["approval_id"] == approval["approval_id"]
        assert asked["approval"]["args"] == {"order_id": "W1", "amount": 333}
        page = pages.signed_in(hash="#/approvals")
        card = page.locator(f"article[data-approval-id='{approval['approval_id']}']")
        card.locator("textarea").fill("approved from the console")
        card.get_by_role("button", name="Approve").click()
        expect(card.locator(".decided-by")).to_have_text(ADMIN)
        decided = wait_until("the decision announced", lambda: announced("approval.decided"))
        assert decided["approval"]["decided_by"] == ADMIN, decided
        assert decided["approval"]["comment"] == "approved from the console", decided
        assert decided["approval"]["status"] == "granted", decided
    finally:
        receiver.close()
        fleet.rein("webhooks", "remove", "--database-url", fleet.database_url, hook)


def test_the_notifications_page_shows_deliveries_and_failures(pages: Pages, fleet: ConsoleFleet) -> None:
    receiver = Receiver()
    try:
        ok = add_webhook(fleet, f"{receiver.url}/ok")
        down = add_webhook(fleet, f"{receiver.url}/down")
        run = lifecycle(fleet)
        fleet.finished(run)
        def tried() -> list[Any] | None:
            rows = fleet.json("GET", "/v1/webhooks/deliveries?limit=50")
            done = {d["webhook_id"] for d in rows if d["run_id"] == run and d["attempts"] >= 1}
            return rows if done >= {ok, down} else None

        deliveries = wait_until("a delivery to each webhook, the failing one tried", tried)
        page = pages.signed_in(hash="#/notifications")
        expect(page.locator("h1")).to_have_text("Notifications")
        expect(page.locator(f"#webhooks tr[data-webhook-id='{ok}']")).to_contain_text("/ok")
        expect(page.locator(f"#webhooks tr[data-webhook-id='{down}']")).to_contain_text("run.finished")
        mine = [d for d in deliveries if d["run_id"] == run]
        good = next(d for d in mine if d["webhook_id"] == ok)
        bad = next(d for d in mine if d["webhook_id"] == down)
        row = page.locator(f"#deliveries tr[data-delivery-id='{good['delivery_id']}']")
        expect(row).to_have_attribute("data-status", "delivered")
        expect(row).to_contain_text("run.finished")
        failed = page.locator(f"#deliveries tr[data-delivery-id='{bad['delivery_id']}']")
        expect(failed).to_have_attribute("data-status", "pending")
        expect(failed).to_contain_text("500")
        assert ("/ok", good["delivery_id"]) in receiver.seen
        # A read-only token sees no deliveries: the API refuses it, and so does the page.
        assert fleet.call("GET", "/v1/webhooks", token=fleet.reader_token).status_code == 403
        shot(page, "notifications")
    finally:
        receiver.close()
        for hook in ("ok", "down"):
            hook_id = locals().get(hook)
            if hook_id:
                fleet.rein("webhooks", "remove", "--database-url", fleet.database_url, hook_id)


def test_a_phone_sized_screen_shows_the_runs_without_overflowing(pages: Pages, fleet: ConsoleFleet) -> None:
    lifecycle(fleet)
    page = pages.signed_in(viewport=PHONE)
    expect(page.locator("tr[data-run-id]").first).to_be_visible()
    widths = page.evaluate("""() => ({
        page: document.documentElement.scrollWidth, view: window.innerWidth,
        header: document.getElementById('header').scrollWidth,
        headerBox: document.getElementById('header').clientWidth,
        table: document.querySelector('.table-wrap').clientWidth })""")
    assert widths["page"] <= widths["view"], widths
    assert widths["header"] <= widths["headerBox"], widths
    assert widths["table"] <= widths["view"], widths
    shot(page, "runs-phone")
    go(page, "#/approvals")
    expect(page.locator("h1")).to_have_text("Approvals")
    assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")



def test_a_model_run_shows_its_calls_token_usage_and_streamed_output(pages: Pages, fleet: ConsoleFleet, model_agent: str) -> None:
    run_id = fleet.enqueue(model_agent, {"order_id": "M1", "amount": 150})
    approval = fleet.approval_of(run_id)
    page = pages.signed_in(hash=f"#/runs/{run_id}")
    expect(page.locator("#stream-state")).to_have_text("● live")
    replied = [e for e in fleet.events(run_id) if e["type"] == "MODEL_REPLIED"]
    assert replied, "the model was not called"
    calls = page.locator("#sec-model-calls ~ * tbody tr:not(.total)")
    expect(calls).to_have_count(len(replied))
    # The model calls after the approval stream their replies to the open page.
    fleet.json("POST", f"/v1/approvals/{approval['approval_id']}/grant", json={"comment": "ok"})
    expect(page.locator("#live-count")).to_contain_text("deltas received", timeout=30_000)
    expect(page.locator("#live-text")).not_to_be_empty()
    assert fleet.finished(run_id)["state"] == "DONE"
    expect(page.locator("#run-state")).to_have_text("DONE")
    replied = [e for e in fleet.events(run_id) if e["type"] == "MODEL_REPLIED"]
    expect(calls).to_have_count(len(replied))
    tokens = sum(e["payload"]["usage"]["tokens"] for e in replied)
    assert tokens > 0
    expect(page.locator("#sec-model-calls ~ * tr.total td").last).to_have_text(str(tokens))
    # The run list shows the same sum from the run's usage, budget or not.
    usage = fleet.run(run_id)["usage"]
    assert usage["input_tokens"] + usage["output_tokens"] == tokens
    shot(page, "run-top")
    page.evaluate("() => document.getElementById('sec-diagram').scrollIntoView({block: 'start'})")
    shot(page, "run")
    go(page, "#/runs")
    expect(page.locator(f'tr[data-run-id="{run_id}"] td.tokens')).to_have_text(str(tokens))


def test_an_in_doubt_call_is_resolved_from_the_run_page(pages: Pages, fleet: ConsoleFleet) -> None:
    # The refund's answer never comes back and there is no reconcile hook: the run waits
    # for an operator.
    script = [{"decision": "call_tool", "tool": "refund", "args": {"order_id": "D1", "amount": 80}},
              {"decision": "FINISH"}]
    run_id = fleet.enqueue("refund-agent", {"agent": {"script": script, "timeout_after_apply": True,
                                                      "no_reconcile": True}})
    wait_until("the run to need an operator", lambda: fleet.run(run_id)["status"] == "needs_operator", 60)
    page = pages.signed_in()
    # The run's definition is held back until the dialog was asked for: an operator who
    # clicks before it arrived still gets its result events to choose from.
    held: list[Any] = []
    page.route("**/v1/definitions/**", lambda route: held.append(route))
    go(page, f"#/runs/{run_id}")
    expect(page.locator("#sec-why ~ *")).to_contain_text("yes")
    expect(page.locator("#sec-pending-action ~ *")).to_contain_text("refund")
    wait_until("the page to ask for the run's definition", lambda: page.evaluate("1") == 1 and bool(held), 20)
    page.click("#resolve-run")
    for route in held:
        route.continue_()
    page.unroute("**/v1/definitions/**")
    dialog = page.locator("dialog")
    dialog.get_by_label("Yes: it took effect; record its result").check()
    dialog.get_by_label("Result event (when it took effect)").select_option("TOOL_SUCCEEDED")
    dialog.get_by_label("Result payload (a JSON object)").fill('{"result": {"checked": "by phone"}}')
    shot(page, "run-resolve-dialog")
    dialog.get_by_role("button", name="Resolve").click()
    expect(page.locator("#run-state")).to_have_text("DONE", timeout=30_000)
    settled = [e for e in fleet.events(run_id) if e["type"] == "TOOL_SUCCEEDED"]
    assert len(settled) == 1 and settled[0]["payload"]["result"] == {"checked": "by phone"}
    assert settled[0]["sender"] == f"operator:{ADMIN}"
    expect(page.locator("#timeline tr[data-type='TOOL_SUCCEEDED'] td.by")).to_have_text(f"operator:{ADMIN}")
