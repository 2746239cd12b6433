//! `rein approvals list`, `rein approve` and `rein deny` against real PostgreSQL: a
//! research-agent run is put into WAITING_APPROVAL by sending it the events of its own
//! transitions (no worker), a request is opened the way the worker opens one, and a person
//! decides it through the CLI.

use crate::common;

use std::process::{Command, Output};
use std::time::Duration;

use common::{rein, stderr, stdout};
use rein_store::{ApprovalAsk, EnqueueRequest, Store};
use serde_json::{Value, json};
use uuid::Uuid;

/// A research-agent run waiting for an approval, driven there without a worker.
async fn waiting_run(store: &Store) -> Uuid {
    let def = store
        .load_definition("research-agent", None)
        .await
        .expect("the built-in research-agent");
    let run = store
        .enqueue(EnqueueRequest::new(def, json!({})))
        .await
        .expect("enqueue")
        .run_id;
    common::as_the_engine(
        store,
        run,
        &["TASK_ACCEPTED", "PLAN_READY", "APPROVAL_REQUIRED"],
    )
    .await;
    assert_eq!(store.run(run).await.expect("run").state, "WAITING_APPROVAL");
    run
}

/// Opens a request for a refund of 150 on order A1, named by `hash`.
async fn ask(store: &Store, run: Uuid, hash: &str, expires_after_ms: u64) -> Uuid {
    store
        .request_approval(ApprovalAsk {
            run_id: run,
            node: "ACTING",
            tool: "refund",
            args: &json!({"order_id": "A1", "amount": 150}),
            action_hash: hash,
            risk: "high",
            expires_after_ms,
        })
        .await
        .expect("request an approval")
        .approval_id
}

/// `rein ARGS` with REIN_APPROVER set to `approver`, or unset.
fn rein_as(args: &[&str], approver: Option<&str>) -> Output {
    let mut cmd = Command::new(common::REIN);
    cmd.args(args).env_remove("DATABASE_URL");
    match approver {
        Some(name) => cmd.env("REIN_APPROVER", name),
        None => cmd.env_remove("REIN_APPROVER"),
    };
    cmd.output().expect("run the rein binary")
}

fn listed(url: &str, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["approvals", "list", "--database-url", url, "--json"];
    args.extend_from_slice(extra);
    let out = rein(&args);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    match serde_json::from_str(&stdout(&out)).expect("a JSON array") {
        Value::Array(items) => items,
        other => panic!("not an array: {other}"),
    }
}

fn find(items: &[Value], id: Uuid) -> Option<&Value> {
    items
        .iter()
        .find(|a| a["approval_id"] == Value::String(id.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approve_moves_the_run_on_and_a_second_decision_is_refused() {
    let (url, store) = common::fresh_store("cli_approve").await;
    let run = waiting_run(&store).await;
    let id = ask(&store, run, "h1", 3_600_000).await;
    let ids = id.to_string();

    let open = listed(&url, &[]);
    let a = find(&open, id).expect("the new request is listed as open");
    assert_eq!(a["run_id"], run.to_string());
    assert_eq!(a["tool"], "refund");
    assert_eq!(a["args"], json!({"order_id": "A1", "amount": 150}));
    assert_eq!(a["risk"], "high");
    assert_eq!(a["status"], "pending");
    assert_eq!(a["open"], true);
    assert_eq!(listed(&url, &["--run", &run.to_string()]).len(), 1);
    assert!(listed(&url, &["--run", &Uuid::now_v7().to_string()]).is_empty());

    let out = rein(&["approvals", "list", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let table = stdout(&out);
    let line = table
        .lines()
        .find(|l| l.starts_with(&ids))
        .unwrap_or_else(|| panic!("a row for {id} in\n{table}"));
    // Expires in an hour: "59m 59s" or a little less.
    for shown in [
        "refund",
        r#"{"amount":150,"order_id":"A1"}"#,
        "high",
        "59m",
        "pending",
    ] {
        assert!(line.contains(shown), "no `{shown}` in {line}");
    }

    let out = rein(&[
        "approve",
        &ids,
        "--as",
        "alice",
        "--comment",
        "ok",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let said = stdout(&out);
    assert_eq!(said.lines().count(), 1, "{said}");
    for shown in ["granted", ids.as_str(), "alice", "APPROVED", "ACTING"] {
        assert!(said.contains(shown), "no `{shown}` in {said}");
    }

    assert_eq!(store.run(run).await.expect("run").state, "ACTING");
    let history = store.history(run).await.expect("history");
    let approved = history
        .iter()
        .find(|e| e.kind == "APPROVED")
        .expect("an APPROVED event in the run's history");
    assert_eq!(approved.payload["approval_id"], ids);
    assert_eq!(approved.payload["approver"], "alice");
    assert_eq!(approved.payload["comment"], "ok");

    assert!(find(&listed(&url, &[]), id).is_none(), "no longer open");
    let all = listed(&url, &["--all"]);
    let a = find(&all, id).expect("--all lists decided requests");
    assert_eq!(a["status"], "granted");
    assert_eq!(a["decided_by"], "alice");
    assert_eq!(a["comment"], "ok");
    assert_eq!(a["open"], false);

    let out = rein(&["approve", &ids, "--as", "bob", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains("already granted by alice"), "{err}");
    let again = history.len();
    assert_eq!(store.history(run).await.expect("history").len(), again);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_on_an_expired_request_is_refused() {
    let (url, store) = common::fresh_store("cli_approve_late").await;
    let run = waiting_run(&store).await;
    let id = ask(&store, run, "h1", 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;

    assert!(
        find(&listed(&url, &[]), id).is_none(),
        "an expired request is not open"
    );
    let all = listed(&url, &["--all"]);
    assert_eq!(find(&all, id).expect("listed with --all")["open"], false);
    let out = rein(&["approvals", "list", "--all", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("expired"), "{}", stdout(&out));

    let out = rein(&[
        "approve",
        &id.to_string(),
        "--as",
        "alice",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("expired"), "{}", stderr(&out));
    assert_eq!(store.run(run).await.expect("run").state, "WAITING_APPROVAL");
    assert_eq!(
        store.approval(id).await.expect("approval").status,
        "pending"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_sends_rejected_and_the_run_is_cancelled() {
    let (url, store) = common::fresh_store("cli_deny").await;
    let run = waiting_run(&store).await;
    let id = ask(&store, run, "h1", 60_000).await;

    // The approver comes from REIN_APPROVER when --as is not given.
    let out = rein_as(
        &[
            "deny",
            &id.to_string(),
            "--comment",
            "too much",
            "--database-url",
            &url,
        ],
        Some("carol"),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let said = stdout(&out);
    for shown in ["denied", "carol", "REJECTED", "CANCELLED"] {
        assert!(said.contains(shown), "no `{shown}` in {said}");
    }

    let row = store.run(run).await.expect("run");
    assert_eq!(row.state, "CANCELLED");
    let history = store.history(run).await.expect("history");
    let rejected = history.last().expect("events");
    assert_eq!(rejected.kind, "REJECTED");
    assert_eq!(rejected.payload["approval_id"], id.to_string());
    assert_eq!(rejected.payload["approver"], "carol");
    let a = store.approval(id).await.expect("approval");
    assert_eq!(a.status, "denied");
    assert_eq!(a.decided_by.as_deref(), Some("carol"));
    assert_eq!(a.comment.as_deref(), Some("too much"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_made_void_by_a_changed_action_is_refused() {
    let (url, store) = common::fresh_store("cli_approve_void").await;
    let run = waiting_run(&store).await;
    let old = ask(&store, run, "h1", 60_000).await;
    let new = ask(&store, run, "h2", 60_000).await;
    assert_ne!(old, new);

    let open = listed(&url, &[]);
    assert!(find(&open, old).is_none(), "the void request is not open");
    assert!(find(&open, new).is_some(), "the new request is open");
    let all = listed(&url, &["--all"]);
    assert_eq!(
        find(&all, old).expect("listed with --all")["status"],
        "void"
    );

    let out = rein(&[
        "approve",
        &old.to_string(),
        "--as",
        "alice",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("void"), "{}", stderr(&out));
    assert_eq!(store.run(run).await.expect("run").state, "WAITING_APPROVAL");
    assert_eq!(
        store.approval(new).await.expect("approval").status,
        "pending"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_a_run_that_ended_is_void_and_no_longer_asked() {
    let (url, store) = common::fresh_store("cli_approve_ended").await;
    let run = waiting_run(&store).await;
    let id = ask(&store, run, "h1", 60_000).await;
    assert!(
        find(&listed(&url, &[]), id).is_some(),
        "open while the run waits"
    );

    let out = rein(&[
        "cancel",
        &run.to_string(),
        "--reason",
        "customer withdrew",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(store.run(run).await.expect("run").status, "terminal");

    assert!(
        find(&listed(&url, &[]), id).is_none(),
        "a request of an ended run is still listed as waiting for a person"
    );
    let all = listed(&url, &["--all"]);
    let request = find(&all, id).expect("listed with --all");
    assert_eq!(request["status"], "void", "{request}");
    let out = rein(&[
        "approve",
        &id.to_string(),
        "--as",
        "alice",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("void"), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_a_clear_error() {
    let (url, store) = common::fresh_store("cli_approve_bad").await;
    let run = waiting_run(&store).await;
    let id = ask(&store, run, "h1", 60_000).await.to_string();

    let unknown = Uuid::now_v7().to_string();
    let out = rein(&["approve", &unknown, "--as", "alice", "--database-url", &url]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "an unknown id is bad input: {}",
        stderr(&out)
    );
    let err = stderr(&out);
    assert!(err.starts_with("error: "), "{err}");
    assert!(
        err.contains(&unknown) && err.contains("no approval request"),
        "{err}"
    );

    let out = rein_as(&["approve", &id, "--database-url", &url], None);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("--as"), "{}", stderr(&out));

    let long = "x".repeat(rein_store::COMMENT_BYTES_MAX + 1);
    let out = rein(&[
        "deny",
        &id,
        "--as",
        "alice",
        "--comment",
        &long,
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("--comment"), "{}", stderr(&out));

    let out = rein(&["approve", &id, "--as", "  ", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("--as"), "{}", stderr(&out));

    let out = rein(&[
        "approve",
        "not-an-id",
        "--as",
        "alice",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));

    // Nothing was decided by any of it.
    let a = store
        .approval(id.parse().expect("uuid"))
        .await
        .expect("approval");
    assert_eq!(a.status, "pending");
    assert_eq!(store.run(run).await.expect("run").state, "WAITING_APPROVAL");
}
