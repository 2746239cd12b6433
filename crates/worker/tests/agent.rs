//! Agent runs against a real PostgreSQL (SPEC D1, D2, X6, X7, H1–H4, M9): a scripted model
//! (the external model, faked) decides; tools run on the sim ledger (an external system that
//! applies each idempotency key once); people decide approvals through the store.

use crate::common;

use std::time::Duration;

use common::{assert_replays, event_types, store, wait_state, wait_until};
use rein_core::{Definition, Format, GuardRegistry};
use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::{EnqueueRequest, Store, StoreError};
use rein_worker::{Worker, WorkerConfig, builtin_registry};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(30);

/// A worker and a scheduler in this process; stopped (and awaited) by `stop`.
struct Fleet {
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Fleet {
    fn start(store: &Store, worker_id: &str) -> Fleet {
        let stop = CancellationToken::new();
        let mut config = WorkerConfig::new(worker_id);
        config.lease_ttl_ms = 2_000;
        config.poll_interval_ms = 20;
        config.shutdown_grace_ms = 1_000;
        let worker = Worker::new(store.clone(), config, builtin_registry(store.clone()));
        let mut sconfig = SchedulerConfig::new(format!("{worker_id}-scheduler"));
        sconfig.tick_ms = 50;
        let mut scheduler = Scheduler::new(store.clone(), sconfig);
        let tasks = vec![
            tokio::spawn({
                let stop = stop.clone();
                async move {
                    worker.run(stop).await.expect("worker run");
                }
            }),
            tokio::spawn({
                let stop = stop.clone();
                async move {
                    scheduler.run(stop).await.expect("scheduler run");
                }
            }),
        ];
        Fleet { stop, tasks }
    }

    async fn stop(self) {
        self.stop.cancel();
        for t in self.tasks {
            t.await.expect("fleet task");
        }
    }
}

fn refund(amount: f64) -> Value {
    json!({ "decision": "call_tool", "tool": "refund",
            "args": { "order_id": "A1", "amount": amount } })
}

async fn start_run(store: &Store, def: &Definition, agent: Value) -> Uuid {
    store
        .enqueue(EnqueueRequest::new(def.clone(), json!({ "agent": agent })))
        .await
        .expect("enqueue")
        .run_id
}

async fn effects(store: &Store, run: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM rein_sim_effects WHERE run_id = $1")
        .bind(run)
        .fetch_one(store.pool())
        .await
        .expect("effects")
}

/// Polls the run's requests (all of them with `all`) until one matches `pick`.
async fn find_request(
    store: &Store,
    run: Uuid,
    all: bool,
    pick: impl Fn(&rein_store::Approval) -> bool,
) -> rein_store::Approval {
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let found = store
            .approvals(all, Some(run), 10)
            .await
            .expect("approvals")
            .into_iter()
            .find(|a| pick(a));
        if let Some(a) = found {
            return a;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no matching approval request for run {run} within {LONG:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn open_request(store: &Store, run: Uuid) -> rein_store::Approval {
    find_request(store, run, false, |_| true).await
}

fn refund_agent() -> Definition {
    rein_core::builtin::refund_agent()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_refund_runs_once_without_approval_and_a_lookup_needs_no_dispatch() {
    let store = store("agent_small").await;
    let run = start_run(
        &store,
        &refund_agent(),
        json!({ "script": [
            { "decision": "call_tool", "tool": "lookup_order", "args": { "order_id": "A1" } },
            refund(50.0),
            { "decision": "FINISH" }] }),
    )
    .await;
    let fleet = Fleet::start(&store, "agent-small");
    wait_state(&store, run, "DONE").await;
    fleet.stop().await;
    assert_eq!(effects(&store, run).await, 1, "the refund applied once");
    let types = event_types(&store, run).await;
    assert_eq!(
        types.iter().filter(|t| *t == "ACTION_DISPATCHED").count(),
        1,
        "only the side-effect call is dispatched: {types:?}"
    );
    assert!(
        !types.iter().any(|t| t == "APPROVAL_REQUESTED"),
        "50 needs no approval: {types:?}"
    );
    assert!(
        store
            .approvals(true, Some(run), 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_granted_refund_uses_its_grant_once_in_the_dispatch_commit() {
    let store = store("agent_granted").await;
    let run = start_run(
        &store,
        &refund_agent(),
        json!({ "script": [refund(150.0), { "decision": "FINISH" }] }),
    )
    .await;
    let fleet = Fleet::start(&store, "agent-granted");
    wait_state(&store, run, "WAITING_APPROVAL").await;
    let request = open_request(&store, run).await;
    assert_eq!(request.tool, "refund");
    assert_eq!(request.args["amount"], json!(150.0));
    assert_eq!(
        effects(&store, run).await,
        0,
        "nothing applied before the grant"
    );
    store
        .decide_approval(request.approval_id, true, "alice", Some("ok"))
        .await
        .expect("grant");
    wait_state(&store, run, "DONE").await;
    fleet.stop().await;

    assert_eq!(effects(&store, run).await, 1, "applied exactly once");
    let used = store.approval(request.approval_id).await.expect("approval");
    assert_eq!(used.status, "granted");
    assert!(used.consumed_at.is_some(), "the grant was used up");
    let history = store.history(run).await.expect("history");
    let dispatched = history
        .iter()
        .find(|e| e.kind == "ACTION_DISPATCHED")
        .expect("dispatched");
    assert_eq!(
        dispatched.payload["approval_id"],
        json!(request.approval_id),
        "the dispatch names the grant it used"
    );
    assert_eq!(
        dispatched.payload["action_hash"],
        json!(request.action_hash)
    );
    // A second decision on a used grant is refused.
    let again = store
        .decide_approval(request.approval_id, true, "bob", None)
        .await
        .expect_err("already decided");
    assert!(
        again.to_string().contains("already granted by alice"),
        "{again}"
    );
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_for_150_runs_150_once_and_a_later_10000_needs_its_own_approval() {
    let store = store("agent_changed").await;
    // A model that, once its approved 150 is done, wants 10,000 more.
    let run = start_run(
        &store,
        &refund_agent(),
        json!({ "script": [refund(150.0), refund(10_000.0), { "decision": "FINISH" }] }),
    )
    .await;
    let fleet = Fleet::start(&store, "agent-changed");
    let request = open_request(&store, run).await;
    store
        .decide_approval(request.approval_id, true, "alice", None)
        .await
        .expect("grant for 150");
    // The engine runs exactly the approved 150; the 10,000 is a new request.
    let first_id = request.approval_id;
    let second = find_request(&store, run, false, |a| a.approval_id != first_id).await;
    assert_eq!(second.args["amount"], json!(10_000.0));
    assert_ne!(second.action_hash, request.action_hash);
    wait_state(&store, run, "WAITING_APPROVAL").await;
    let first_now = store.approval(request.approval_id).await.unwrap();
    assert_eq!(first_now.status, "granted");
    assert!(first_now.consumed_at.is_some(), "the 150 grant is spent");
    assert_eq!(
        effects(&store, run).await,
        1,
        "the 150, and nothing of the 10,000"
    );
    let applied: Value =
        sqlx::query_scalar("SELECT result FROM rein_sim_idempotency WHERE run_id = $1")
            .bind(run)
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(applied["args"]["amount"], json!(150.0), "{applied}");
    // Denied, the 10,000 never runs; the run ends.
    store
        .decide_approval(second.approval_id, false, "alice", Some("too much"))
        .await
        .expect("deny");
    wait_until("the run to end", LONG, || async {
        store.run(run).await.unwrap().status == "terminal"
    })
    .await;
    fleet.stop().await;
    assert_eq!(effects(&store, run).await, 1);
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approved_refund_that_fails_transiently_is_retried_under_its_key_without_a_new_approval()
{
    let store = store("agent_approved_retry").await;
    let run = start_run(
        &store,
        &refund_agent(),
        json!({ "script": [refund(150.0), { "decision": "FINISH" }], "fail_first": 1 }),
    )
    .await;
    let fleet = Fleet::start(&store, "agent-approved-retry");
    let request = open_request(&store, run).await;
    store
        .decide_approval(request.approval_id, true, "alice", None)
        .await
        .expect("grant");
    wait_state(&store, run, "DONE").await;
    fleet.stop().await;
    assert_eq!(effects(&store, run).await, 1, "applied exactly once");
    let requests = store.approvals(true, Some(run), 10).await.unwrap();
    assert_eq!(requests.len(), 1, "no new approval: {requests:?}");
    let history = store.history(run).await.unwrap();
    let types: Vec<&str> = history.iter().map(|e| e.kind.as_str()).collect();
    assert!(types.contains(&"TOOL_RETRYABLE_FAILED"), "{types:?}");
    let dispatches: Vec<&Value> = history
        .iter()
        .filter(|e| e.kind == "ACTION_DISPATCHED")
        .map(|e| &e.payload)
        .collect();
    assert_eq!(dispatches.len(), 2, "{types:?}");
    assert_eq!(dispatches[0]["approval_id"], json!(request.approval_id));
    assert_eq!(
        dispatches[1]["approval_id"],
        Value::Null,
        "the grant is used once"
    );
    assert_eq!(
        dispatches[0]["idempotency_key"], dispatches[1]["idempotency_key"],
        "the retry runs under the same key"
    );
    assert_eq!(dispatches[1]["action_hash"], json!(request.action_hash));
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_granted_refund_that_times_out_after_sending_is_reconciled_not_repeated() {
    let store = store("agent_in_doubt").await;
    let run = start_run(
        &store,
        &refund_agent(),
        json!({ "script": [refund(150.0), { "decision": "FINISH" }],
                "timeout_after_apply": true }),
    )
    .await;
    let fleet = Fleet::start(&store, "agent-in-doubt");
    let request = open_request(&store, run).await;
    store
        .decide_approval(request.approval_id, true, "alice", None)
        .await
        .expect("grant");
    wait_state(&store, run, "DONE").await;
    fleet.stop().await;
    assert_eq!(effects(&store, run).await, 1, "applied exactly once");
    let history = store.history(run).await.unwrap();
    let types: Vec<&str> = history.iter().map(|e| e.kind.as_str()).collect();
    let in_doubt = types
        .iter()
        .position(|t| *t == "ACTION_RESULT_IN_DOUBT")
        .unwrap_or_else(|| panic!("no in-doubt record: {types:?}"));
    assert_eq!(
        types.iter().filter(|t| **t == "ACTION_DISPATCHED").count(),
        1,
        "never dispatched twice: {types:?}"
    );
    let success = &history[in_doubt + 1];
    assert_eq!(success.kind, "TOOL_SUCCEEDED", "{types:?}");
    assert_eq!(
        success.payload["reconciled"],
        json!(true),
        "found by its key"
    );
    assert_replays(&store, run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_doubt_refund_without_a_reconcile_hook_waits_for_an_operator() {
    let store = store("agent_operator").await;
    let run = start_run(
        &store,
        &refund_agent(),
        json!({ "script": [refund(80.0), { "decision": "FINISH" }],
                "timeout_after_apply": true, "no_reconcile": true }),
    )
    .await;
    let fleet = Fleet::start(&store, "agent-operator");
    wait_until("the run needs an operator", LONG, || async {
        store.run(run).await.unwrap().status == "needs_operator"
    })
    .await;
    fleet.stop().await;
    let row = store.run(run).await.unwrap();
    assert_eq!(row.state, "ACTING", "it stays where the call was made");
    assert_eq!(
        effects(&store, run).await,
        1,
        "applied once, never repeated"
    );
    let types = event_types(&store, run).await;
    assert_eq!(
        types.iter().filter(|t| *t == "ACTION_DISPATCHED").count(),
        1,
        "{types:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_approval_takes_the_expiry_path_and_a_late_grant_is_refused() {
    let store = store("agent_expired").await;
    // The built-in waits an hour; this copy waits 300 ms.
    let next = rein_core::builtin::refund_agent().version() + 1;
    let text = rein_core::builtin::source_at_version("refund-agent", next)
        .expect("a built-in")
        .replace(
            "expires_after_ms = 3600000, remind_before_ms = 600000",
            "expires_after_ms = 300",
        );
    let def = Definition::parse(&text, Format::Toml, &GuardRegistry::new()).expect("valid");
    store.register_definition(&def).await.expect("register");
    let run = start_run(
        &store,
        &def,
        json!({ "script": [refund(150.0), { "decision": "FINISH" }] }),
    )
    .await;
    let fleet = Fleet::start(&store, "agent-expired");
    let request = find_request(&store, run, true, |_| true).await;
    wait_state(&store, run, "EXPIRED").await;
    fleet.stop().await;
    let late = store
        .decide_approval(request.approval_id, true, "alice", None)
        .await
        .expect_err("too late");
    assert!(
        matches!(&late, StoreError::Invalid(m) if m.contains("expired")),
        "{late}"
    );
    assert_eq!(store.run(run).await.unwrap().state, "EXPIRED");
    assert_eq!(effects(&store, run).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_decisions_are_recorded_with_their_step_and_the_definition_decides_what_next() {
    let store = store("agent_rejected").await;
    let cases = [
        (
            json!({ "decision": "call_tool", "tool": "wire_money", "args": {} }),
            "tool",
        ),
        (
            json!({ "decision": "call_tool", "tool": "refund", "args": { "order_id": "A1", "amount": -1 } }),
            "schema",
        ),
        (json!({ "decision": "TOOL_SUCCEEDED" }), "decision"),
        (json!("refund everything"), "parse"),
    ];
    let mut runs = Vec::new();
    for (decision, step) in &cases {
        runs.push((
            start_run(&store, &refund_agent(), json!({ "script": [decision] })).await,
            *step,
        ));
    }
    let fleet = Fleet::start(&store, "agent-rejected");
    for (run, _) in &runs {
        wait_state(&store, *run, "FAILED").await;
    }
    fleet.stop().await;
    for (run, step) in runs {
        let history = store.history(run).await.unwrap();
        let rejected = history
            .iter()
            .find(|e| e.kind == "DECISION_REJECTED")
            .unwrap_or_else(|| panic!("no DECISION_REJECTED for the {step} case"));
        assert_eq!(
            rejected.payload["step"],
            json!(step),
            "{}",
            rejected.payload
        );
        assert!(
            rejected.payload["reason"]
                .as_str()
                .is_some_and(|r| !r.is_empty()),
            "{}",
            rejected.payload
        );
        let last = history.last().unwrap();
        assert_eq!(
            last.kind, "DECISION_FAILED",
            "on_rejected_decision moved it"
        );
        assert_eq!(effects(&store, run).await, 0);
        assert_replays(&store, run).await;
    }
}
