"""The client and the node SDK against a real `rein api` + `rein worker` + `rein scheduler`
on PostgreSQL (see conftest.py), never a stand-in for Rein."""

from __future__ import annotations

import asyncio
import uuid

import pytest

import rein
from rein import errors

from conftest import ROOT, Fleet, NodeServer, eventually


def types_of(events: list[rein.Event]) -> list[str]:
    return [e.type for e in events]


def test_enqueue_with_the_same_key_twice_is_one_run(client: rein.Client) -> None:
    key = f"py-{uuid.uuid4()}"
    first = client.enqueue("lifecycle", {"sim": {"work_ms": 1}}, key=key)
    second = client.enqueue("lifecycle", {"sim": {"work_ms": 1}}, key=key)
    assert first.created and not second.created
    assert first.run_id == second.run_id
    # The same key with another body is a conflict, raised with the key in its details.
    with pytest.raises(errors.Conflict) as refused:
        client.enqueue("lifecycle", {"sim": {"work_ms": 2}}, key=key)
    assert refused.value.details["idempotency_key"] == key
    assert refused.value.status == 409


def test_a_python_node_run_goes_to_its_end(client: rein.Client, desk: NodeServer) -> None:
    run = client.enqueue("refund-desk", {"order_id": "A1", "amount": 30})
    done = client.wait(run, timeout=60)
    assert (done.state, done.status) == ("SUCCEEDED", "terminal")
    history = client.history(run)
    kinds = types_of(history)
    assert kinds[-1] == "CUSTOMER_NOTIFIED", kinds
    for wanted in ("REQUEST_ACCEPTED", "ACTION_DISPATCHED", "REFUNDED"):
        assert wanted in kinds, kinds
    # The refund went out under the idempotency key Rein dispatched REFUNDING with, once.
    dispatched = [e for e in history if e.type == "ACTION_DISPATCHED" and e.node == "REFUNDING"]
    assert len(dispatched) == 1
    key = dispatched[0].payload["idempotency_key"]
    assert desk.refunds(key) == [(key, "A1", 30.0)]
    refunded = next(e for e in history if e.type == "REFUNDED")
    assert refunded.payload["result"]["order_id"] == "A1"
    # The run's data holds what NOTIFYING merged in.
    assert "refunded 30" in client.get_run(run).data["notice"]


def test_a_fatal_error_in_a_node_takes_the_fatal_event(client: rein.Client, desk: NodeServer) -> None:
    run = client.enqueue("refund-desk", {"order_id": "A2", "amount": -5})
    done = client.wait(run, timeout=60)
    assert done.state == "FAILED"
    failed = [e for e in client.history(run) if e.type == "INVALID_REQUEST"]
    assert len(failed) == 1
    assert failed[0].payload["error"]["status"] == 422


def test_an_approval_granted_from_python_lets_the_run_finish(client: rein.Client, fleet: Fleet) -> None:
    script = [
        {"decision": "call_tool", "tool": "refund", "args": {"order_id": "B7", "amount": 420}},
        {"decision": "FINISH"},
    ]
    run = client.enqueue("refund-agent", {"agent": {"script": script}})
    approval = eventually("the approval request", lambda: client.approvals(run=run), fleet)[0]
    assert approval.tool == "refund" and approval.args == {"order_id": "B7", "amount": 420}
    # Still parked: wait gives up and says where the run is.
    with pytest.raises(rein.WaitTimeout) as parked:
        client.wait(run, timeout=0.3)
    assert parked.value.run.status == "parked"
    decided = client.approve(approval, "within policy")
    assert decided.status == "granted" and decided.comment == "within policy"
    assert decided.decided_by == "py-admin"
    done = client.wait(run, timeout=60)
    assert done.status == "terminal" and done.state == "DONE", done
    assert client.approvals(run=run) == []
    # Deciding again is refused.
    with pytest.raises(errors.Conflict):
        client.deny(approval)


def test_a_refused_transition_raises_invalid_transition_with_the_state(client: rein.Client) -> None:
    run = client.enqueue("lifecycle", {"sim": {"work_ms": 1}})
    done = client.wait(run, timeout=60)
    with pytest.raises(rein.InvalidTransition) as refused:
        client.cancel(run)
    assert refused.value.details["state"] == done.state
    assert refused.value.details["event"] == "CANCEL"
    assert refused.value.code == "invalid_transition" and refused.value.status == 409


def test_a_node_server_killed_mid_call_is_reconciled_and_refunds_once(
    client: rein.Client, desk: NodeServer, fleet: Fleet
) -> None:
    run = client.enqueue(
        "refund-desk", {"order_id": "K9", "amount": 75, "provider_delay_ms": 120_000}
    )
    # The provider has paid and is slow to answer: kill the node server inside the call.
    key = eventually(
        "the refund at the provider",
        lambda: [r[0] for r in desk.refunds() if r[1] == "K9"],
        fleet,
    )[0]
    desk.kill()
    # Rein sees the connection drop: the call is in doubt; it keeps asking the reconcile
    # endpoint until the server is back.
    eventually(
        "the call in doubt",
        lambda: "ACTION_RESULT_IN_DOUBT" in types_of(client.history(run)),
        fleet,
    )
    desk.start()
    done = client.wait(run, timeout=60)
    assert done.state == "SUCCEEDED", (done, types_of(client.history(run)))
    history = client.history(run)
    kinds = types_of(history)
    refunding = [e for e in history if e.type == "ACTION_DISPATCHED" and e.node == "REFUNDING"]
    assert len(refunding) == 1, kinds  # never dispatched again: reconciled as applied
    assert refunding[0].payload["idempotency_key"] == key
    assert kinds.index("ACTION_RESULT_IN_DOUBT") < kinds.index("REFUNDED"), kinds
    assert "ACTION_NOT_APPLIED" not in kinds
    # The side effect happened once, and the reconciled result is the provider's receipt.
    assert desk.refunds(key) == [(key, "K9", 75.0)]
    refunded = next(e for e in history if e.type == "REFUNDED")
    assert refunded.payload["result"]["order_id"] == "K9"


def test_a_token_lacking_a_scope_raises_forbidden(fleet: Fleet) -> None:
    reader = fleet.token("py-reader", "read")
    with rein.Client(fleet.api_url, reader) as c:
        with pytest.raises(rein.Forbidden) as refused:
            c.enqueue("lifecycle", {})
        assert refused.value.details["required_scope"] == "enqueue"
        assert refused.value.status == 403
        assert c.workers()  # what `read` allows still works
    with rein.Client(fleet.api_url, "not-a-token") as c:
        with pytest.raises(rein.Unauthorized):
            c.workers()


def test_unknown_runs_raise_not_found(client: rein.Client) -> None:
    missing = uuid.uuid4()
    with pytest.raises(rein.NotFound) as refused:
        client.get_run(missing)
    assert refused.value.details["run_id"] == str(missing)


def test_list_runs_follows_the_cursor_across_pages(client: rein.Client) -> None:
    name = f"py_cursor_{uuid.uuid4().hex[:8]}"
    text = (ROOT / "definitions" / "lifecycle.toml").read_text()
    assert 'name = "lifecycle"' in text
    text = text.replace('name = "lifecycle"', f'name = "{name}"', 1)
    client.register_definition(text)
    ids = {client.enqueue(name, {"sim": {"work_ms": 1}}).run_id for _ in range(5)}
    listed = [r.run_id for r in client.list_runs(definition=name, page_size=2)]
    assert sorted(listed) == sorted(ids)
    assert len(listed) == 5


def test_the_env_names_the_server_and_token(
    fleet: Fleet, admin_token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REIN_URL", fleet.api_url)
    monkeypatch.setenv("REIN_TOKEN", admin_token)
    with rein.Client() as c:
        assert c.url == fleet.api_url
        assert c.ready().status == "ready"
        run = c.enqueue("lifecycle", {"sim": {"work_ms": 1}})
        why = c.why(run)
        assert why.run_id == run.run_id and why.waiting_for


def test_the_async_client_has_the_same_surface(fleet: Fleet, admin_token: str) -> None:
    async def story() -> None:
        async with rein.AsyncClient(fleet.api_url, admin_token) as c:
            run = await c.enqueue("lifecycle", {"sim": {"work_ms": 1}}, key=f"a-{uuid.uuid4()}")
            done = await c.wait(run, timeout=60)
            assert done.status == "terminal"
            events = await c.history(run, page_size=1)
            assert [e.sequence for e in events] == list(range(1, len(events) + 1))
            assert len(events) >= 2
            seen = [r.run_id async for r in c.list_runs(page_size=1) if r.run_id == run.run_id]
            assert seen == [run.run_id]
            with pytest.raises(rein.InvalidTransition):
                await c.cancel(run)
            workers = await c.workers()
            assert {w.worker_id for w in workers} >= {"py-worker", "py-scheduler"}

    asyncio.run(story())


def test_definitions_register_once_and_read_back(client: rein.Client, desk: NodeServer) -> None:
    again = client.register_definition(desk.definition())
    assert (again.name, again.created) == ("refund-desk", False)
    got = client.get_definition("refund-desk")
    assert got.version == 1 and got.current
    assert "refund-desk" in {d.name for d in client.definitions()}
    with pytest.raises(rein.ValidationFailed):
        client.register_definition('name = "broken"\nversion = 1\n')


def test_a_send_with_a_key_is_applied_once(client: rein.Client, fleet: Fleet) -> None:
    script = [
        {"decision": "call_tool", "tool": "refund", "args": {"order_id": "C3", "amount": 999}},
        {"decision": "FINISH"},
    ]
    run = client.enqueue("refund-agent", {"agent": {"script": script}})
    eventually("the approval request", lambda: client.approvals(run=run), fleet)
    key = f"cancel-{uuid.uuid4()}"
    first = client.cancel(run, key=key)
    again = client.cancel(run, key=key)
    assert (again.outcome, again.sequence, again.inbox_id) == (
        first.outcome, first.sequence, first.inbox_id)
    done = client.wait(run, timeout=60)
    assert done.status == "terminal"
    assert types_of(client.history(run)).count("CANCEL") == 1


def test_rerun_verify_and_brief(client: rein.Client, fleet: Fleet) -> None:
    run = client.enqueue("lifecycle", {"sim": {"work_ms": 1}})
    first = client.wait(run, timeout=60)
    again = client.rerun(first)
    assert again.parent_run_id == first.run_id and again.run_id != first.run_id
    second = client.wait(again, timeout=60)
    assert second.state == first.state
    assert client.verify(second).ok
    assert client.brief(first).brief
    # A run that has not finished cannot be rerun.
    script = [{"decision": "call_tool", "tool": "refund", "args": {"order_id": "D4", "amount": 500}}]
    parked = client.enqueue("refund-agent", {"agent": {"script": script}})
    eventually("the approval request", lambda: client.approvals(run=parked), fleet)
    with pytest.raises(errors.Conflict):
        client.rerun(parked)
    client.cancel(parked)


def test_fork_a_finished_run_and_plan_a_migration(client: rein.Client, fleet: Fleet) -> None:
    first = client.wait(
        client.enqueue("lifecycle", {"sim": {"work_ms": 1}}), timeout=60)
    history = list(client.history(first))
    dispatched = next(e for e in history if e.type == "ACTION_DISPATCHED")
    # At an open call a fork is refused; before it, between steps, it is not.
    with pytest.raises(errors.Conflict):
        client.fork(first, dispatched.sequence)
    fork = client.fork(first, dispatched.sequence - 1, reason="again")
    assert fork.forked_from == first.run_id and fork.at_sequence == dispatched.sequence - 1
    done = client.wait(fork.run_id, timeout=60)
    assert done.status == "terminal" and done.parent_run_id == first.run_id
    assert client.verify(done).ok
    assert list(client.history(done))[0].type == "RUN_FORKED"
    # Migrating to the version a run is on already is refused before anything moves.
    with pytest.raises(errors.Conflict):
        client.migrate_runs("lifecycle", 2, 2, dry_run=True)


def test_redact_forgets_a_key_and_the_run_still_verifies(client: rein.Client) -> None:
    run = client.wait(
        client.enqueue("lifecycle", {"sim": {"work_ms": 1}, "email": "ada@example.org"}),
        timeout=60)
    with pytest.raises(errors.ValidationFailed):
        client.redact(run, [], "no keys")
    with pytest.raises(TypeError):
        client.redact(run, "email", "one string")
    done = client.redact(run, ["email"], "erasure request")
    assert done.finished and done.run_id == run.run_id
    assert [h.field for h in done.hashes] == ["email"]
    assert client.verify(run).ok


def test_whatif_on_the_runs_own_version_is_the_same_outcome(client: rein.Client) -> None:
    run = client.wait(client.enqueue("lifecycle", {"sim": {"work_ms": 1}}), timeout=60)
    same = client.whatif(run)
    assert same.verdict == "same" and same.divergence is None
    assert same.definition.name == "lifecycle"
    with pytest.raises(errors.NotFound):
        client.whatif(run, "lifecycle@999")


def test_a_blob_no_run_refers_to_is_not_found(client: rein.Client) -> None:
    with pytest.raises(errors.NotFound):
        client.blob("0" * 64)
    with pytest.raises(errors.ValidationFailed):
        client.blob("not-a-hash")


def test_stream_follows_a_run_to_its_end_and_resumes_after_an_id(client: rein.Client) -> None:
    run = client.enqueue("lifecycle", {"sim": {"work_ms": 20, "steps": 3}})
    items = list(client.stream(run))
    assert isinstance(items[-1], rein.sse.End), items[-1]
    assert items[-1].data["status"] == "terminal"
    committed = [i.event for i in items if isinstance(i, rein.sse.Committed)]
    history = client.history(run)
    assert [e.sequence for e in committed] == [e.sequence for e in history]
    assert [e.type for e in committed] == [e.type for e in history]
    # Resumed after sequence 2: only what came after, nothing twice.
    again = [i.event.sequence for i in client.stream(run, last_event_id="2")
             if isinstance(i, rein.sse.Committed)]
    assert again == [e.sequence for e in history if e.sequence > 2]


def test_the_async_stream_ends_like_the_sync_one(fleet: Fleet, admin_token: str) -> None:
    async def follow() -> list[str]:
        async with rein.AsyncClient(fleet.api_url, admin_token) as c:
            run = await c.enqueue("lifecycle", {"sim": {"work_ms": 5}})
            return [item.kind async for item in c.stream(run)]

    kinds = asyncio.run(follow())
    assert kinds[-1] == "end" and "committed" in kinds, kinds


def test_me_names_the_token_and_runs_filter_by_queue_and_state(client: rein.Client) -> None:
    me = client.me()
    assert me.subject == "py-admin" and "admin" in me.scopes
    # No worker serves this queue, so its runs stay where they start.
    queue = f"py_q_{uuid.uuid4().hex[:8]}"
    ids = {client.enqueue("lifecycle", {"sim": {"work_ms": 1}}, queue=queue).run_id for _ in range(3)}
    listed = list(client.list_runs(queue=queue))
    assert {r.run_id for r in listed} == ids
    assert all(r.queue == queue and r.last_event is None for r in listed)
    state = listed[0].state
    assert {r.run_id for r in client.list_runs(queue=queue, state=state)} == ids
    assert list(client.list_runs(queue=queue, state="NO_SUCH_STATE")) == []
    cancelled = next(iter(ids))
    client.cancel(cancelled)
    run = client.get_run(cancelled)
    assert run.last_event is not None and run.last_event.type == "CANCEL"
    assert run.last_event.sequence == run.sequence


def test_a_run_without_a_budget_shows_its_model_usage(client: rein.Client, fleet: Fleet) -> None:
    # A stand-in OpenAI-compatible server (a model API is an outside party) and a worker of
    # its own queue bound to it: the shipped support agent declares a price, no budget.
    _, line = fleet.spawn("standin", [str(fleet.binary), "stand-in-model"], first_line=True)
    base_url = "http://" + line.removeprefix("listening on ").strip() + "/v1"
    fleet.spawn("model-worker", [
        str(fleet.binary), "worker", "--id", "py-model-worker", "--queue", "py-model",
        "--lease-ttl-ms", "2000", "--database-url", fleet.database_url,
    ], env={"REIN_MODEL_URL": base_url, "REIN_MODEL_KEYS": f"OPENAI_API_KEY={base_url}",
            "OPENAI_API_KEY": "sk-test-python-client-0123456789"})
    run = client.enqueue("support-agent", {"order_id": "P1", "amount": 5}, queue="py-model")
    done = client.wait(run, timeout=90)
    assert done.state == "DONE", fleet.logs()
    replies = [e.payload["usage"] for e in client.history(run) if e.type == "MODEL_REPLIED"]
    assert len(replies) >= 2
    assert done.usage is not None
    assert done.usage.calls == len(replies)
    assert done.usage.input_tokens == sum(u["input_tokens"] for u in replies)
    assert done.usage.output_tokens == sum(u["output_tokens"] for u in replies)
    assert done.usage.cost is not None and done.usage.cost > 0
    assert done.usage.reasoning_tokens is None  # never reported: null, not 0
    usage = client.usage(run)
    assert [m.model for m in usage.models] == ["gpt-4o-mini"]
    assert usage.total == done.usage
    # A run with no model call has no usage, rather than zeros.
    quiet = client.wait(client.enqueue("lifecycle", {"sim": {"work_ms": 1}}), timeout=60)
    assert quiet.usage is None
    assert client.usage(quiet).models == []
