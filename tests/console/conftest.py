"""The web console in a real browser against a real fleet.

The fleet is the Python client tests' (clients/python/tests/rein_fleet.py): a fresh
PostgreSQL database, `rein migrate`, `rein api`, a worker and a scheduler as child processes
in their own process groups, always stopped. The browser is the system's Chromium
(CHROMIUM, default /usr/bin/chromium) driven by Playwright, headless.

`rein api` serves the console embedded in the binary; REIN_CONSOLE_DIR=DIR passes
`--console-dir DIR` instead (to try edits without a rebuild). Screenshots of every page go
to target/console-screenshots/<name>.png.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
from playwright.sync_api import Browser, Page, Playwright, sync_playwright

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "clients" / "python" / "tests"))

from rein_fleet import Fleet, eventually, fresh_database  # noqa: E402

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
SHOTS = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target") / "console-screenshots"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 375, "height": 740}
ALL_SCOPES = ("read", "enqueue", "operate", "approve", "publish", "admin")
ADMIN = "console-admin"
READER = "console-reader"
REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379"
MODEL_AGENT = "console-model-agent"


class ConsoleFleet(Fleet):
    """A fleet whose API serves the console, with tokens and a JSON client for setting up."""

    admin_token = ""
    reader_token = ""

    def http(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, timeout=30,
                            headers={"Authorization": f"Bearer {token or self.admin_token}"})

    def call(self, method: str, path: str, token: str | None = None, **kw: Any) -> httpx.Response:
        with self.http(token) as c:
            return c.request(method, path, **kw)

    def json(self, method: str, path: str, **kw: Any) -> Any:
        r = self.call(method, path, **kw)
        assert r.status_code < 300, f"{method} {path}: {r.status_code} {r.text}"
        return r.json()

    def enqueue(self, definition: str, input: Any, **body: Any) -> str:
        return str(self.json("POST", "/v1/runs", json={"definition": definition, "input": input, **body})["run_id"])

    def refund(self, amount: float, order: str) -> str:
        """A refund-agent run whose scripted model refunds `amount` (over 100 waits for a person)."""
        script = [
            {"decision": "call_tool", "tool": "lookup_order", "args": {"order_id": order}},
            {"decision": "call_tool", "tool": "refund", "args": {"order_id": order, "amount": amount}},
            {"decision": "FINISH"},
        ]
        return self.enqueue("refund-agent", {"agent": {"script": script}})

    def run(self, run_id: str) -> Any:
        return self.json("GET", f"/v1/runs/{run_id}")

    def approval_of(self, run_id: str) -> Any:
        """The run's open approval request, once it has one."""
        return eventually(f"an approval request of {run_id}",
                          lambda: self.json("GET", "/v1/approvals", params={"run": run_id}), self)[0]

    def finished(self, run_id: str) -> Any:
        return eventually(f"{run_id} to finish",
                          lambda: (r := self.run(run_id))["status"] == "terminal" and r, self)

    def events(self, run_id: str) -> list[Any]:
        out: list[Any] = []
        after = 0
        while True:
            page = self.json("GET", f"/v1/runs/{run_id}/events",
                             params={"envelope": "true", "after": after, "limit": 500})
            out += page["events"]
            if page["next_after"] is None:
                return out
            after = page["next_after"]


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleFleet]:
    url, drop = fresh_database()
    fleet = ConsoleFleet(tmp_path_factory.mktemp("console-fleet"), url)
    try:
        fleet.rein("migrate", "--database-url", url)
        # Redis carries a model's streamed deltas from the worker to the API's run streams.
        redis = ["--redis-url", REDIS_URL, "--redis-prefix", f"console-{secrets.token_hex(4)}"]
        api = ["api", "--listen", "127.0.0.1:0", *redis]
        if os.environ.get("REIN_CONSOLE_DIR"):
            api += ["--console-dir", os.environ["REIN_CONSOLE_DIR"]]
        _, fleet.api_url = fleet.spawn_rein("api", *api, first_line=True)
        fleet.spawn_rein("worker", "worker", "--id", "console-worker", "--lease-ttl-ms", "2000",
                         "--poll-interval-ms", "20", *redis)
        fleet.spawn_rein("scheduler", "scheduler", "--id", "console-scheduler")
        fleet.admin_token = fleet.token(ADMIN, *ALL_SCOPES)
        fleet.reader_token = fleet.token(READER, "read")
        yield fleet
    finally:
        fleet.stop()
        drop()


@pytest.fixture(scope="session")
def model_agent(fleet: ConsoleFleet) -> str:
    """A copy of the built-in support-agent whose model is `rein stand-in-model` (a fake
    Chat Completions server: the model API is an outside party) and streams its replies."""
    _, line = fleet.spawn("model", [str(fleet.binary), "stand-in-model", "--listen", "127.0.0.1:0"],
                          first_line=True)
    assert line.startswith("listening on "), line
    addr = line.removeprefix("listening on ").strip()
    text = (ROOT / "definitions" / "support-agent.toml").read_text()
    text = text.replace('name = "support-agent"', f'name = "{MODEL_AGENT}"', 1)
    text = "\n".join(l for l in text.splitlines() if not l.startswith("api_key_env"))
    text = text.replace('model = "gpt-4o-mini"', f'model = "gpt-4o-mini"\nbase_url = "http://{addr}/v1"\nstream = true', 1)
    r = fleet.call("POST", "/v1/definitions", content=text.encode(),
                   headers={"Content-Type": "application/toml"})
    assert r.status_code in (200, 201), r.text
    return MODEL_AGENT


@pytest.fixture(scope="session")
def playwright() -> Iterator[Playwright]:
    if not Path(CHROMIUM).is_file():
        raise RuntimeError(f"no Chromium at {CHROMIUM}: apt-get install -y chromium (or set CHROMIUM)")
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="session")
def browser(playwright: Playwright) -> Iterator[Browser]:
    b = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
    try:
        yield b
    finally:
        b.close()


class Pages:
    """Opens pages in fresh browser contexts (nothing shared between them: no storage, no
    cookies), and fails the test on any page error or Content-Security-Policy violation."""

    def __init__(self, browser: Browser, fleet: ConsoleFleet) -> None:
        self.browser, self.fleet = browser, fleet
        self.contexts: list[Any] = []
        self.problems: list[str] = []

    def open(self, viewport: dict[str, int] = DESKTOP) -> Page:
        context = self.browser.new_context(viewport=viewport)
        self.contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(20_000)
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        page.on("console", lambda m: self._console(m))
        page.goto(self.fleet.api_url + "/")
        page.wait_for_selector("#token")
        return page

    def _console(self, message: Any) -> None:
        text = message.text
        if "Content Security Policy" in text or "Refused to" in text:
            self.problems.append(f"CSP: {text}")
        elif message.type == "error" and "Failed to load resource" not in text:
            self.problems.append(f"console error: {text}")

    def signed_in(self, token: str | None = None, viewport: dict[str, int] = DESKTOP, hash: str = "") -> Page:
        page = self.open(viewport)
        sign_in(page, token or self.fleet.admin_token)
        if hash:
            go(page, hash)
        return page

    def close(self) -> None:
        for c in self.contexts:
            c.close()


def sign_in(page: Page, token: str) -> None:
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_selector("#whoami")
    page.wait_for_selector("main[data-rendered]")


def rendered(page: Page) -> int:
    return int(page.get_attribute("#main", "data-rendered") or 0)


def after_route(page: Page, action: Callable[[], Any]) -> None:
    """Runs `action` (which changes the page's route) and waits until the new page is
    rendered, so that no locator finds the page it replaced."""
    before = rendered(page)
    action()
    page.wait_for_function("n => Number(document.getElementById('main').dataset.rendered) > n", arg=before)


def go(page: Page, hash: str) -> None:
    after_route(page, lambda: page.evaluate("h => { location.hash = h; }", hash))


@pytest.fixture()
def pages(browser: Browser, fleet: ConsoleFleet) -> Iterator[Pages]:
    p = Pages(browser, fleet)
    try:
        yield p
        assert not p.problems, "\n".join(p.problems)
    finally:
        p.close()


def shot(page: Page, name: str) -> Path:
    """Saves a screenshot of the page as it is now to target/console-screenshots/NAME.png."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.wait_for_timeout(150)
    page.screenshot(path=str(path), full_page=False)
    return path


def wait_until(what: str, probe: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    until = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > until:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)
