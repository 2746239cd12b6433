"""The README's refund story told through a client openapi-python-client generated from the
served document (package `rein_client` in the working directory):

    python client_story.py BASE_URL TOKEN

enqueues the built-in refund-agent with the README's input (an approval is needed for 420),
waits for the worker to ask, grants the request, waits for the run to end, and reads its
history page by page with the cursor in the body. Errors come back as the error body, typed.
Prints one JSON object: run_id, approval_id, status, history (event types in order).
"""

import json
import os
import sys
import time
import uuid

# The generated package is in the working directory, not beside this file.
sys.path.insert(0, os.getcwd())

from rein_client import AuthenticatedClient
from rein_client.api.approvals import grant_approval, list_approvals
from rein_client.api.runs import enqueue_run, get_run, list_runs, run_events
from rein_client.models import (
    DecideBody,
    EnqueueBody,
    ErrorBody,
    ErrorCode,
    EventsPageView,
    ListRunsStatus,
    RunsPageView,
    RunView,
    Status,
)

DEADLINE_S = 30.0


def wait_for(what, probe):
    """probe() until it returns something truthy, at most DEADLINE_S."""
    until = time.monotonic() + DEADLINE_S
    while time.monotonic() < until:
        got = probe()
        if got:
            return got
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def expect(cond, message):
    if not cond:
        raise SystemExit(message)


def main(base_url, token):
    client = AuthenticatedClient(base_url=base_url, token=token, raise_on_unexpected_status=True)

    body = EnqueueBody.from_dict(
        {
            "definition": "refund-agent",
            "input": {
                "agent": {
                    "script": [
                        {"decision": "call_tool", "tool": "refund", "args": {"order_id": "B7", "amount": 420}},
                        {"decision": "FINISH"},
                    ]
                }
            },
        }
    )
    created = enqueue_run.sync_detailed(client=client, body=body, idempotency_key="order-B7")
    expect(created.status_code == 201, f"enqueue: {created.status_code} {created.content!r}")
    run_id = created.parsed.run_id

    # The same key and body again: the same run.
    again = enqueue_run.sync_detailed(client=client, body=body, idempotency_key="order-B7")
    expect(again.status_code == 200 and again.parsed.run_id == run_id, f"replay: {again.content!r}")

    def open_request():
        page = list_approvals.sync(client=client, run=run_id)
        expect(isinstance(page, list), f"list_approvals: {page!r}")
        return page[0] if page else None

    approval = wait_for("the approval request", open_request)
    decided = grant_approval.sync(client=client, id=approval.approval_id, body=DecideBody(comment="checked the order"))
    expect(not isinstance(decided, ErrorBody), f"grant: {decided!r}")
    expect(decided.status.value == "granted", f"grant: {decided.to_dict()}")

    def finished():
        run = get_run.sync(client=client, id=run_id)
        expect(isinstance(run, RunView), f"get_run: {run!r}")
        return run if run.status == Status.TERMINAL else None

    run = wait_for("the run to finish", finished)

    # The run among the terminal ones, as a page object.
    listed = list_runs.sync(client=client, status=ListRunsStatus.TERMINAL, envelope=True, limit=10)
    expect(isinstance(listed, RunsPageView), f"list_runs envelope: {listed!r}")
    expect(any(r.run_id == run_id for r in listed.runs), f"list_runs: {listed.to_dict()}")

    # The history, two events a page, following next_after in the body.
    history, after = [], 0
    while True:
        page = run_events.sync(client=client, id=run_id, after=after, limit=2, envelope=True)
        expect(isinstance(page, EventsPageView), f"run_events: {page!r}")
        history.extend(e.type_ for e in page.events)
        if not page.next_after:
            break
        after = page.next_after

    # Errors parse as the error body with a typed code, not as None.
    missing = get_run.sync_detailed(client=client, id=uuid.uuid4())
    expect(missing.status_code == 404, f"missing run: {missing.status_code}")
    expect(isinstance(missing.parsed, ErrorBody), f"404 parsed as {missing.parsed!r}")
    expect(missing.parsed.error.code == ErrorCode.NOT_FOUND, f"404: {missing.parsed.to_dict()}")
    twice = grant_approval.sync_detailed(client=client, id=approval.approval_id)
    expect(twice.status_code == 409 and isinstance(twice.parsed, ErrorBody), f"grant twice: {twice.content!r}")
    bogus = client.get_httpx_client().get("/v1/runs", params={"status": "bogus"})
    expect(bogus.status_code == 422, f"status=bogus: {bogus.status_code} {bogus.text}")
    refused = ErrorBody.from_dict(bogus.json())
    expect(refused.error.code == ErrorCode.VALIDATION_FAILED, f"status=bogus: {bogus.text}")

    print(
        json.dumps(
            {
                "run_id": str(run_id),
                "approval_id": str(approval.approval_id),
                "status": run.status.value,
                "state": run.state,
                "history": history,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
