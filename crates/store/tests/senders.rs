//! Who may send what to a run (SPEC Z3), who the log says sent it, idempotent sends (E2),
//! client keys scoped to their caller (I3, Z4), and text PostgreSQL cannot store (Z2).

use crate::common;

use common::{assert_replays, event_types, store};
use rein_core::{Definition, Format, GuardRegistry, builtin};
use rein_store::{
    ClientKey, CommitOutcome, CommitPlan, EnqueueRequest, INBOX_TTL_MS_DEFAULT, SendOutcome,
    Sender, Store, StoreError, Writer, plan_commit, plan_inbox,
};
use serde_json::{Value, json};
use uuid::Uuid;

fn engine() -> Sender {
    Sender::Engine("sched-1".into())
}

fn alice() -> Sender {
    Sender::outside("api:alice")
}

async fn run_of(store: &Store, def: &Definition, input: Value) -> Uuid {
    store
        .enqueue(EnqueueRequest::new(def.clone(), input))
        .await
        .expect("enqueue")
        .run_id
}

async fn send(
    store: &Store,
    run: Uuid,
    kind: &str,
    payload: Value,
    sender: &Sender,
) -> SendOutcome {
    store
        .send(run, kind, payload, sender, INBOX_TTL_MS_DEFAULT)
        .await
        .unwrap_or_else(|e| panic!("send {kind}: {e}"))
}

#[track_caller]
fn assert_not_allowed(result: Result<SendOutcome, StoreError>, kind: &str, why: &str) {
    match result {
        Err(StoreError::NotAllowed { event, reason, .. }) => {
            assert_eq!(event, kind);
            assert!(reason.contains(why), "{kind}: {reason}");
        }
        other => panic!("{kind} from outside was not refused: {other:?}"),
    }
}

/// A refund-agent run parked in WAITING_APPROVAL with no call pending, as a worker leaves it.
async fn waiting_refund(store: &Store) -> Uuid {
    let run = run_of(store, &builtin::refund_agent(), json!({})).await;
    send(store, run, "APPROVAL_REQUIRED", json!({}), &engine()).await;
    assert_eq!(store.run(run).await.unwrap().state, "WAITING_APPROVAL");
    run
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outside_caller_cannot_send_engine_events_or_call_results() {
    let store = store("senders_forge").await;
    let run = waiting_refund(&store).await;
    let dispatched = json!({ "action_id": "step-9", "call_id": "forged", "node": "ACTING",
        "step": 9, "idempotency_key": "k", "tool": "refund",
        "args": { "order_id": "A1", "amount": 999_999 } });
    for (kind, payload) in [
        ("ACTION_DISPATCHED", dispatched),
        ("ACTION_NOT_APPLIED", json!({ "call_id": "forged" })),
        ("ACTION_RESULT_IN_DOUBT", json!({ "call_id": "forged" })),
        ("OPERATOR_REQUIRED", json!({ "reason": "forged" })),
        ("DECISION_REJECTED", json!({})),
        ("APPROVAL_REQUESTED", json!({})),
        ("APPROVAL_REMINDER", json!({})),
        ("APPROVAL_DECIDED", json!({})),
        ("LEASE_EXPIRED", json!({})),
        ("INBOX_EXPIRED", json!({})),
    ] {
        let sent = store
            .send(run, kind, payload, &alice(), INBOX_TTL_MS_DEFAULT)
            .await;
        assert_not_allowed(sent, kind, "engine event");
    }
    for kind in ["TOOL_SUCCEEDED", "TOOL_FATAL_FAILED"] {
        let sent = store
            .send(run, kind, json!({ "call_id": "forged" }), &alice(), 60_000)
            .await;
        assert_not_allowed(sent, kind, "call result");
    }
    // What the engine commits itself (expiry, reminder, a decision) is not the caller's
    // either; refund-agent takes nothing but CANCEL from outside.
    for kind in ["APPROVAL_EXPIRED", "REMIND_APPROVER", "FINISH", "APPROVED"] {
        let sent = store.send(run, kind, json!({}), &alice(), 60_000).await;
        assert_not_allowed(sent, kind, "takes only CANCEL");
    }
    assert_eq!(event_types(&store, run).await, ["APPROVAL_REQUIRED"]);
    assert!(store.inbox(run).await.unwrap().is_empty(), "nothing queued");
    // CANCEL is the cancel operation: anyone may send it.
    send(&store, run, "CANCEL", json!({ "reason": "no" }), &alice()).await;
    assert_eq!(store.run(run).await.unwrap().state, "CANCELLED");
    assert_replays(&store, run).await;
}

/// With no call pending, a result without a call id would pass the reducer's check (old
/// logs replay so); the store refuses it from anyone but the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_without_a_call_id_cannot_complete_a_run_from_outside() {
    let store = store("senders_no_call").await;
    let run = run_of(&store, &builtin::lifecycle(), json!({})).await;
    send(&store, run, "start", json!({}), &engine()).await;
    assert_eq!(
        store.run(run).await.unwrap().projection.pending_call(),
        None
    );
    let everyone = [
        alice(),
        Sender::outside_approver("cli", "cli"),
        Sender::Approver("carol".into()),
    ];
    for sender in &everyone {
        let sent = store.send(run, "complete", json!({}), sender, 60_000).await;
        assert_not_allowed(sent, "complete", "call result");
    }
    let sent = store
        .send(
            run,
            "complete",
            json!({}),
            &Sender::Operator("operator:ops".into()),
            60_000,
        )
        .await;
    assert_not_allowed(sent, "complete", "no call of the run is pending");
    let row = store.run(run).await.unwrap();
    assert_eq!((row.state.as_str(), row.last_sequence), ("running", 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_settles_only_the_pending_call_and_is_recorded() {
    let store = store("senders_operator").await;
    let run = run_of(&store, &builtin::refund_agent(), json!({})).await;
    let dispatched = json!({ "action_id": "step-1", "call_id": "c-1", "node": "ACTING",
        "step": 1, "idempotency_key": "k-1", "tool": "lookup_order" });
    send(&store, run, "ACTION_DISPATCHED", dispatched, &engine()).await;
    let ops = Sender::Operator("operator:ops".into());
    let sent = store
        .send(run, "TOOL_SUCCEEDED", json!({ "result": 1 }), &ops, 60_000)
        .await;
    assert_not_allowed(sent, "TOOL_SUCCEEDED", "must name the pending call c-1");
    // An operator has no more rights than an outside caller otherwise.
    let sent = store.send(run, "FINISH", json!({}), &ops, 60_000).await;
    assert_not_allowed(sent, "FINISH", "takes only CANCEL");
    let sent = send(
        &store,
        run,
        "TOOL_SUCCEEDED",
        json!({ "call_id": "c-1", "result": 1, "resolved_by": "operator:ops" }),
        &ops,
    )
    .await;
    assert_eq!(sent, SendOutcome::Applied { sequence: 2 });
    let history = store.history(run).await.unwrap();
    assert_eq!(
        history[0].sender, None,
        "the engine's own event names no sender"
    );
    assert_eq!(history[1].sender.as_deref(), Some("operator:ops"));
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_event_needs_a_sender_who_may_approve() {
    let store = store("senders_approve").await;
    let lifecycle = builtin::lifecycle();
    let run = run_of(&store, &lifecycle, json!({})).await;
    send(&store, run, "start", json!({}), &engine()).await;
    send(&store, run, "pause_for_approval", json!({}), &engine()).await;
    let refused = store
        .send(run, "approval_granted", json!({}), &alice(), 60_000)
        .await;
    assert!(
        matches!(&refused, Err(StoreError::NeedsApprover { event }) if event == "approval_granted"),
        "{refused:?}"
    );
    let bob = Sender::outside_approver("api:bob", "bob");
    // Whoever the payload says approved, the approver recorded is the sender's identity.
    let claimed = json!({ "approver": "cfo@example.com", "note": "ok",
                          "data": { "last_approval": { "approver": "cfo@example.com" } } });
    send(&store, run, "approval_granted", claimed, &bob).await;
    let history = store.history(run).await.unwrap();
    assert_eq!(history[2].sender.as_deref(), Some("api:bob"));
    assert_eq!(
        history[2].worker, "api:bob",
        "written without a lease, by the sender"
    );
    assert_eq!(history[2].payload["approver"], "bob");
    assert_eq!(history[2].payload["note"], "ok", "the rest is kept");
    let row = store.run(run).await.unwrap();
    assert_eq!(row.projection.data["last_approval"]["approver"], "bob");
}

/// A definition whose working state takes a nudge from outside, to queue one under a lease.
const NUDGE: &str = r#"
name = "nudge"
version = 1
cancel_state = "cancelled"
events = ["nudge", "done"]
external_events = ["nudge"]

[[states]]
name = "work"
kind = "active"
initial = true

[[states]]
name = "finished"
kind = "terminal"

[[states]]
name = "cancelled"
kind = "terminal"

[[transitions]]
from = "work"
event = "nudge"
to = "work"

[[transitions]]
from = "work"
event = "done"
to = "finished"
"#;

async fn nudge_run(store: &Store) -> (Definition, Uuid) {
    let def = Definition::parse(NUDGE, Format::Toml, &GuardRegistry::new()).expect("valid");
    store.register_definition(&def).await.expect("register");
    let run = run_of(store, &def, json!({})).await;
    (def, run)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_applied_from_the_inbox_records_who_sent_it() {
    let store = store("senders_inbox").await;
    let (def, run) = nudge_run(&store).await;
    let claimed = store
        .claim("worker-a", 1, 30_000, &["default".to_owned()])
        .await
        .unwrap()
        .remove(0);
    let sent = send(
        &store,
        run,
        "nudge",
        json!({ "data": { "n": 1 } }),
        &alice(),
    )
    .await;
    assert!(matches!(sent, SendOutcome::Queued { .. }), "{sent:?}");
    // The lease holder applies it at its commit point.
    let (events, consumed) = plan_inbox(&def, &claimed.state, store.inbox(run).await.unwrap());
    let request = plan_commit(
        &def,
        run,
        claimed.token,
        &claimed.state,
        events,
        consumed,
        CommitPlan {
            writer: Writer::Leased,
            release: false,
            jitter_sample: 0.5,
        },
    )
    .unwrap();
    let outcome = store.commit_batch("worker-a", &[request]).await.unwrap();
    assert!(
        matches!(outcome[0], CommitOutcome::Committed(_)),
        "{outcome:?}"
    );
    let history = store.history(run).await.unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(
        history[0].worker, "worker-a",
        "the writer is the lease holder"
    );
    assert_eq!(
        history[0].sender.as_deref(),
        Some("api:alice"),
        "who sent it"
    );
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_repeated_with_its_key_returns_the_first_result() {
    let store = store("senders_key").await;
    let (_, run) = nudge_run(&store).await;
    let once = |payload: Value, key: &'static str| {
        let store = store.clone();
        async move {
            store
                .send_once(run, "nudge", payload, &alice(), key, 60_000)
                .await
        }
    };
    let first = once(json!({ "n": 1 }), "k-1").await.unwrap();
    assert_eq!(first, SendOutcome::Applied { sequence: 1 });
    assert_eq!(once(json!({ "n": 1 }), "k-1").await.unwrap(), first);
    // The same key with another payload is another request: refused, naming the key.
    match once(json!({ "n": 2 }), "k-1").await {
        Err(StoreError::KeyConflict { key, .. }) => assert_eq!(key, "k-1"),
        other => panic!("{other:?}"),
    }
    // The same key from another sender is its own.
    let bob = store
        .send_once(
            run,
            "nudge",
            json!({ "n": 1 }),
            &Sender::outside("api:bob"),
            "k-1",
            60_000,
        )
        .await
        .unwrap();
    assert_eq!(bob, SendOutcome::Applied { sequence: 2 });

    // Under a live lease it waits in the inbox, once.
    store
        .claim("worker-a", 1, 30_000, &["default".to_owned()])
        .await
        .unwrap();
    let queued = once(json!({ "n": 3 }), "k-2").await.unwrap();
    assert!(matches!(queued, SendOutcome::Queued { .. }), "{queued:?}");
    assert_eq!(once(json!({ "n": 3 }), "k-2").await.unwrap(), queued);
    assert_eq!(store.inbox(run).await.unwrap().len(), 1);
    assert_eq!(event_types(&store, run).await, ["nudge", "nudge"]);
}

fn keyed(def: &Definition, caller: &str, key: &str, input: Value) -> EnqueueRequest {
    let mut request = EnqueueRequest::new(def.clone(), input);
    request.client_key = Some(ClientKey::new(caller, key));
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_keys_belong_to_their_caller_and_to_one_request() {
    let store = store("senders_enqueue_key").await;
    let def = builtin::lifecycle();
    let first = store
        .enqueue(keyed(&def, "api:alice", "order-42", json!({ "n": 1 })))
        .await
        .unwrap();
    assert!(first.created);
    let again = store
        .enqueue(keyed(&def, "api:alice", "order-42", json!({ "n": 1 })))
        .await
        .unwrap();
    assert_eq!((again.run_id, again.created), (first.run_id, false));

    // Another body under the same key: a conflict naming the key, and nothing created.
    for other in [
        keyed(&def, "api:alice", "order-42", json!({ "n": 2 })),
        {
            let mut r = keyed(&def, "api:alice", "order-42", json!({ "n": 1 }));
            r.queue = "other".into();
            r
        },
        keyed(
            &builtin::research_agent(),
            "api:alice",
            "order-42",
            json!({ "n": 1 }),
        ),
    ] {
        match store.enqueue(other).await {
            Err(e @ StoreError::KeyConflict { .. }) => {
                assert!(e.to_string().contains("order-42"), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }
    // A batch with one reused key creates none of its runs.
    let batch = [
        keyed(&def, "api:alice", "fresh", json!({})),
        keyed(&def, "api:alice", "order-42", json!({ "n": 3 })),
    ];
    assert!(matches!(
        store.enqueue_batch(&batch).await,
        Err(StoreError::KeyConflict { .. })
    ));
    let runs: i64 = sqlx::query_scalar("SELECT count(*) FROM rein_runs")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(runs, 1);

    // Another caller's same key is another key: its own run, never alice's.
    let bob = store
        .enqueue(keyed(&def, "api:bob", "order-42", json!({ "n": 1 })))
        .await
        .unwrap();
    assert!(bob.created);
    assert_ne!(bob.run_id, first.run_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_for_the_newest_version_survives_a_new_version() {
    let store = store("senders_key_version").await;
    let v1 = builtin::lifecycle();
    let ask = |def: &Definition| {
        let mut r = keyed(def, "cli", "k", json!({}));
        r.version_asked = None;
        r
    };
    let first = store.enqueue(ask(&v1)).await.unwrap();
    let text = builtin::LIFECYCLE.replacen("version = 1", "version = 2", 1);
    let v2 = Definition::parse(&text, Format::Toml, &GuardRegistry::new()).unwrap();
    store.register_definition(&v2).await.unwrap();
    let retry = store.enqueue(ask(&v2)).await.unwrap();
    assert_eq!((retry.run_id, retry.created), (first.run_id, false));
    // Naming a version is another request.
    let mut pinned = keyed(&v2, "cli", "k", json!({}));
    pinned.version_asked = Some(2);
    assert!(matches!(
        store.enqueue(pinned).await,
        Err(StoreError::KeyConflict { .. })
    ));
}

/// Keys stored before keys had callers and body hashes (as the migration leaves them) keep
/// returning their runs, to any caller and for any body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_stored_before_callers_keep_their_runs() {
    let store = store("senders_key_legacy").await;
    let def = builtin::lifecycle();
    let old = run_of(&store, &def, json!({})).await;
    sqlx::query("INSERT INTO rein_enqueue_keys (client_key, run_id) VALUES ('legacy', $1)")
        .bind(old)
        .execute(store.pool())
        .await
        .unwrap();
    for caller in ["api:alice", "cli"] {
        let found = store
            .enqueue(keyed(&def, caller, "legacy", json!({ "any": caller })))
            .await
            .unwrap();
        assert_eq!((found.run_id, found.created), (old, false), "{caller}");
    }
}

#[track_caller]
fn assert_field(result: Result<impl std::fmt::Debug, StoreError>, want: &str) {
    match result {
        Err(StoreError::InvalidField { field, reason }) => {
            assert_eq!(field, want);
            assert!(reason.contains("NUL"), "{reason}");
        }
        other => panic!("{want}: not refused by name: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_with_a_nul_character_is_refused_by_name_before_the_database() {
    let store = store("senders_nul").await;
    let def = builtin::lifecycle();
    assert_field(store.load_definition("x\0y", None).await, "definition");
    let mut request = EnqueueRequest::new(def.clone(), json!({ "customer": { "name": "a\0b" } }));
    assert_field(store.enqueue(request.clone()).await, "input.customer.name");
    request.input = json!({});
    request.queue = "q\0".into();
    assert_field(store.enqueue(request.clone()).await, "queue");
    request.queue = "default".into();
    request.client_key = Some(ClientKey::new("cli", "k\0"));
    assert_field(store.enqueue(request).await, "idempotency_key");

    let (_, run) = nudge_run(&store).await;
    assert_field(
        store
            .send(run, "nu\0dge", json!({}), &alice(), 60_000)
            .await,
        "type",
    );
    assert_field(
        store
            .send(
                run,
                "nudge",
                json!({ "items": ["ok", "b\0"] }),
                &alice(),
                60_000,
            )
            .await,
        "payload.items[1]",
    );
    assert_field(
        store
            .send(run, "nudge", json!({}), &Sender::outside("al\0ice"), 60_000)
            .await,
        "sender",
    );
    assert_field(
        store
            .send_once(run, "nudge", json!({}), &alice(), "k\0", 60_000)
            .await,
        "idempotency_key",
    );
    let filter = rein_store::RunFilter {
        status: Some("run\0nable".into()),
        ..Default::default()
    };
    assert_field(store.list_runs_page(&filter, None, 10).await, "status");
    let text = NUDGE.replacen("version = 1", "version = 2\ndescription = \"a\\u0000b\"", 1);
    let described = Definition::parse(&text, Format::Toml, &GuardRegistry::new()).unwrap();
    assert_field(
        store.register_definition(&described).await,
        "definition.description",
    );
    assert_field(
        store
            .decide_approval(Uuid::now_v7(), true, "carol", Some("c\0"))
            .await,
        "comment",
    );
    assert!(store.history(run).await.unwrap().is_empty());
}

/// A database whose built-ins were registered before they declared `external_events` still
/// migrates, keeps the bodies its runs started with, and those bodies still keep outside
/// callers to what their runs wait for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn built_ins_stored_before_their_external_events_still_migrate_and_guard() {
    let store = store("senders_old_builtins").await;
    sqlx::query(
        "UPDATE rein_definitions SET body = body - 'external_events', hash = 'stored-before'
         WHERE name IN ('lifecycle', 'research-agent') AND version = 2",
    )
    .execute(store.pool())
    .await
    .unwrap();
    store
        .migrate()
        .await
        .expect("migrate keeps the stored bodies");
    let hash: String = sqlx::query_scalar(
        "SELECT hash FROM rein_definitions WHERE name = 'lifecycle' AND version = 2",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(hash, "stored-before");
    let stored = store.load_definition("lifecycle", Some(2)).await.unwrap();
    assert!(stored.spec().external_events.is_none());
    let run = run_of(&store, &stored, json!({})).await;
    send(&store, run, "start", json!({}), &engine()).await;
    let sent = store
        .send(run, "complete", json!({}), &alice(), 60_000)
        .await;
    assert_not_allowed(sent, "complete", "call result");
    let sent = store
        .send(run, "dependency_resolved", json!({}), &alice(), 60_000)
        .await;
    assert!(matches!(sent, Ok(SendOutcome::Queued { .. })), "{sent:?}");
}
