//! The refund story of seed 003 §1 with real processes: a model asks for a refund of 150
//! (over the 100 threshold), so the run waits for a person; meanwhile its worker is killed
//! with SIGKILL and another takes over; then the approver denies. The refund is applied zero
//! times and the run ends on the denial path.

use crate::common;

use std::time::Duration;

use common::{Fleet, rein, stderr, wait_for};
use rein_store::EnqueueRequest;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_refund_is_never_applied_even_across_a_worker_crash() {
    let (url, store) = common::fresh_store("refund_story").await;
    let def = store
        .load_definition("refund-agent", None)
        .await
        .expect("refund-agent is built in");
    let run = store
        .enqueue(EnqueueRequest::new(
            def,
            json!({ "agent": { "script": [
                { "decision": "call_tool", "tool": "lookup_order", "args": { "order_id": "A1" } },
                { "decision": "call_tool", "tool": "refund",
                  "args": { "order_id": "A1", "amount": 150 } },
                { "decision": "FINISH" }] } }),
        ))
        .await
        .expect("enqueue")
        .run_id;

    let worker_args = [
        "worker",
        "--lease-ttl-ms",
        "1000",
        "--poll-interval-ms",
        "20",
    ];
    let mut fleet = Fleet::new(&url, "refund_story");
    fleet.spawn("story-w1", &worker_args);
    fleet.spawn("story-s1", &["scheduler", "--tick-ms", "50"]);

    let waiting = || async {
        store
            .run(run)
            .await
            .is_ok_and(|r| r.state == "WAITING_APPROVAL")
    };
    wait_for(
        "the run to wait for approval",
        Duration::from_secs(60),
        Duration::from_millis(20),
        waiting,
    )
    .await;
    fleet.kill("story-w1");
    fleet.spawn("story-w2", &worker_args);

    // The approver finds the request and denies it from the CLI.
    let request = common::open_request(&url, run);
    assert_eq!(request["tool"], "refund");
    assert_eq!(request["args"]["amount"], json!(150));
    let id = request["approval_id"].as_str().expect("id").to_owned();
    let out = rein(&[
        "deny",
        &id,
        "--as",
        "carol",
        "--comment",
        "not eligible",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    wait_for(
        "the run to end",
        Duration::from_secs(60),
        Duration::from_millis(20),
        || async { store.run(run).await.is_ok_and(|r| r.status == "terminal") },
    )
    .await;
    let row = store.run(run).await.expect("run");
    assert_eq!(row.state, "DENIED", "{:?}", row.terminal_reason);
    let applied: i64 =
        sqlx::query_scalar("SELECT count(*) FROM rein_sim_effects WHERE run_id = $1")
            .bind(run)
            .fetch_one(store.pool())
            .await
            .expect("effects");
    assert_eq!(applied, 0, "a denied refund is never applied");
    let history = store.history(run).await.expect("history");
    let rejected = history
        .iter()
        .find(|e| e.kind == "REJECTED")
        .expect("the denial is in the log");
    assert_eq!(rejected.payload["approver"], "carol");
    assert_eq!(rejected.payload["approval_id"], json!(id));
    assert!(
        !history.iter().any(|e| e.kind == "ACTION_DISPATCHED"),
        "the refund was never dispatched"
    );
    let report = store.audit().await.expect("audit");
    assert_eq!(report.violations(), 0, "{report:?}");
}

/// A refund whose answer never came back, with no reconcile hook: the run waits for an
/// operator, who settles it from the CLI. `not-applied` lets the step be dispatched again
/// under the same idempotency key (the ledger still applies it once); `applied` commits the
/// call's result and the run finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_resolves_an_in_doubt_refund_from_the_cli() {
    let (url, store) = common::fresh_store("refund_resolve").await;
    let def = store
        .load_definition("refund-agent", None)
        .await
        .expect("refund-agent is built in");
    let run = store
        .enqueue(EnqueueRequest::new(
            def,
            json!({ "agent": {
                "script": [
                    { "decision": "call_tool", "tool": "refund",
                      "args": { "order_id": "A2", "amount": 80 } },
                    { "decision": "FINISH" }],
                "timeout_after_apply": true, "no_reconcile": true } }),
        ))
        .await
        .expect("enqueue")
        .run_id;
    let mut fleet = Fleet::new(&url, "refund_resolve");
    fleet.spawn(
        "resolve-w1",
        &[
            "worker",
            "--lease-ttl-ms",
            "5000",
            "--poll-interval-ms",
            "20",
        ],
    );
    fleet.spawn("resolve-s1", &["scheduler", "--tick-ms", "50"]);
    let needs_operator = || async {
        store
            .run(run)
            .await
            .is_ok_and(|r| r.status == "needs_operator")
    };
    wait_for(
        "the run to need an operator",
        Duration::from_secs(60),
        Duration::from_millis(20),
        needs_operator,
    )
    .await;
    let run_s = run.to_string();

    // Refused without saying who, or without the result event for `applied`.
    let out = rein(&[
        "resolve",
        &run_s,
        "applied",
        "--as",
        "ops",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("--event"), "{}", stderr(&out));

    let out = rein(&[
        "resolve",
        &run_s,
        "not-applied",
        "--as",
        "ops",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // Dispatched again under the same key; the hanging sim leaves it in doubt again.
    wait_for(
        "a second dispatch",
        Duration::from_secs(60),
        Duration::from_millis(20),
        || async {
            store
                .history(run)
                .await
                .is_ok_and(|h| h.iter().filter(|e| e.kind == "ACTION_DISPATCHED").count() == 2)
        },
    )
    .await;
    wait_for(
        "the run to need an operator again",
        Duration::from_secs(60),
        Duration::from_millis(20),
        needs_operator,
    )
    .await;
    let history = store.history(run).await.expect("history");
    let keys: Vec<&Value> = history
        .iter()
        .filter(|e| e.kind == "ACTION_DISPATCHED")
        .map(|e| &e.payload["idempotency_key"])
        .collect();
    assert_eq!(keys[0], keys[1], "the same key on the second dispatch");
    assert!(history.iter().any(|e| e.kind == "ACTION_NOT_APPLIED"));

    let out = rein(&[
        "resolve",
        &run_s,
        "applied",
        "--event",
        "TOOL_SUCCEEDED",
        "--payload",
        r#"{"result": {"checked": "by phone"}}"#,
        "--as",
        "ops",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    wait_for(
        "the run to finish",
        Duration::from_secs(60),
        Duration::from_millis(20),
        || async { store.run(run).await.is_ok_and(|r| r.state == "DONE") },
    )
    .await;
    let applied: i64 =
        sqlx::query_scalar("SELECT count(*) FROM rein_sim_effects WHERE run_id = $1")
            .bind(run)
            .fetch_one(store.pool())
            .await
            .expect("effects");
    assert_eq!(applied, 1, "applied once across both dispatches");
    // Both settlements are in the log under the operator's name.
    let history = store.history(run).await.expect("history");
    for kind in ["ACTION_NOT_APPLIED", "TOOL_SUCCEEDED"] {
        let settled = history
            .iter()
            .find(|e| e.kind == kind)
            .unwrap_or_else(|| panic!("no {kind}"));
        assert_eq!(settled.sender.as_deref(), Some("operator:ops"), "{kind}");
    }

    // Nothing left to resolve.
    let out = rein(&[
        "resolve",
        &run_s,
        "not-applied",
        "--as",
        "ops",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}
