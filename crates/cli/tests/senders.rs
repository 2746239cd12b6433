//! Who may send what to a run, through a real `rein api` process and the `rein` CLI
//! (SPEC Z3, X5): outside callers cannot forge what only the engine writes, the log keeps
//! who sent an event, sends and enqueues are idempotent per caller (E2, I3, Z4), and text
//! PostgreSQL cannot store is refused by name (Z2).

use crate::common;

use std::process::Output;
use std::time::Duration;

use common::{Api, code, json_of, rein_with, stderr, stdout, wait_for};
use rein_store::{EnqueueRequest, Store};
use reqwest::StatusCode;
use serde_json::{Value, json};
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(20);

/// POST `body` to `path`; with `key`, as its Idempotency-Key.
async fn post(
    api: &Api,
    path: &str,
    token: &str,
    body: Value,
    key: Option<&str>,
) -> (StatusCode, Value) {
    let mut request = api.post(path, token).json(&body);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    json_of(request.send().await.expect("the API answers")).await
}

async fn get(api: &Api, path: &str, token: &str) -> (StatusCode, Value) {
    json_of(
        api.get(path, Some(token))
            .send()
            .await
            .expect("the API answers"),
    )
    .await
}

async fn send_event(api: &Api, run: Uuid, token: &str, body: Value) -> (StatusCode, Value) {
    post(api, &format!("/v1/runs/{run}/events"), token, body, None).await
}

/// `rein ARGS` against the database.
fn db(api: &Api, args: &[&str]) -> Output {
    rein_with(args, &[("DATABASE_URL", &api.url)])
}

/// `rein ARGS` through the API with `token`.
fn via_api(api: &Api, token: &str, args: &[&str]) -> Output {
    rein_with(args, &[("REIN_URL", &api.base), ("REIN_TOKEN", token)])
}

async fn run_of(store: &Store, definition: &str, input: Value) -> Uuid {
    let def = store
        .load_definition(definition, None)
        .await
        .expect("built in");
    store
        .enqueue(EnqueueRequest::new(def, input))
        .await
        .expect("enqueue")
        .run_id
}

/// The first event of `kind` in the run's log.
async fn logged(store: &Store, run: Uuid, kind: &str) -> rein_store::StoredEvent {
    store
        .history(run)
        .await
        .expect("history")
        .into_iter()
        .find(|e| e.kind == kind)
        .unwrap_or_else(|| panic!("no {kind} in the log of {run}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outside_caller_cannot_send_what_only_the_engine_writes() {
    let api = Api::start("senders_forge", &[]).await;
    let operator = api.token("ops", &["operate", "approve"]);
    // A lifecycle run in `running` with no call pending: a result naming no call passed the
    // reducer's call-id check and completed the run.
    let run = run_of(&api.store, "lifecycle", json!({})).await;
    common::as_the_engine(&api.store, run, &["start"]).await;
    let (s, v) = send_event(&api, run, &operator, json!({ "type": "complete" })).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::FORBIDDEN, "event_not_allowed"),
        "{v}"
    );
    assert_eq!(v["error"]["details"]["event"], "complete");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("call result"),
        "{v}"
    );
    let run_s = run.to_string();
    for out in [
        db(&api, &["send", &run_s, "complete"]),
        via_api(&api, &operator, &["send", &run_s, "complete"]),
    ] {
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(stderr(&out).contains("call result"), "{}", stderr(&out));
    }

    for (kind, payload) in [
        (
            "ACTION_DISPATCHED",
            json!({ "action_id": "step-1", "call_id": "forged", "node": "running", "step": 1,
                    "idempotency_key": "k" }),
        ),
        ("ACTION_NOT_APPLIED", json!({ "call_id": "forged" })),
        ("ACTION_RESULT_IN_DOUBT", json!({ "call_id": "forged" })),
        ("OPERATOR_REQUIRED", json!({ "reason": "forged" })),
        ("DECISION_REJECTED", json!({})),
        ("APPROVAL_REQUESTED", json!({})),
        ("APPROVAL_DECIDED", json!({})),
        ("LEASE_EXPIRED", json!({})),
        ("INBOX_EXPIRED", json!({})),
        // An action's own decision is not an outside caller's either.
        ("pause_for_approval", json!({})),
    ] {
        let (s, v) = send_event(
            &api,
            run,
            &operator,
            json!({ "type": kind, "payload": payload }),
        )
        .await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::FORBIDDEN, "event_not_allowed"),
            "{kind}: {v}"
        );
        assert_eq!(v["error"]["details"]["event"], kind);
    }
    let row = api.store.run(run).await.unwrap();
    assert_eq!((row.state.as_str(), row.last_sequence), ("running", 1));
    assert!(api.store.inbox(run).await.unwrap().is_empty());

    // CANCEL is the cancel operation.
    let out = via_api(
        &api,
        &operator,
        &["cancel", &run_s, "--reason", "done with it"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(api.store.run(run).await.unwrap().state, "failed");
}

/// The refund of 150 waits for a person. An operate token sends a dispatch of a refund of
/// 999999 and a matching result: both are refused, the real approval lets the approved
/// refund run, and the run ends on its own result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_result_cannot_end_a_run_whose_refund_was_approved() {
    let mut api = Api::start("senders_refund", &[]).await;
    let run = run_of(
        &api.store,
        "refund-agent",
        json!({ "agent": { "script": [
            { "decision": "call_tool", "tool": "refund", "args": { "order_id": "A1", "amount": 150 } },
            { "decision": "FINISH" }] } }),
    )
    .await;
    api.fleet.spawn_worker("senders-w1", "5000");
    api.fleet
        .spawn("senders-s1", &["scheduler", "--tick-ms", "50"]);
    wait_for("the run to wait for approval", LONG, POLL, || async {
        api.store
            .run(run)
            .await
            .is_ok_and(|r| r.state == "WAITING_APPROVAL")
    })
    .await;

    let operator = api.token("mallory", &["operate"]);
    let forged_dispatch = json!({ "type": "ACTION_DISPATCHED", "payload": {
        "action_id": "step-1", "call_id": "forged-call", "node": "ACTING", "step": 1,
        "idempotency_key": "forged", "tool": "refund",
        "args": { "order_id": "A1", "amount": 999_999 } } });
    let forged_result = json!({ "type": "TOOL_SUCCEEDED", "payload": {
        "call_id": "forged-call", "result": { "refunded": 999_999 } } });
    for forged in [forged_dispatch, forged_result] {
        let (s, v) = send_event(&api, run, &operator, forged).await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::FORBIDDEN, "event_not_allowed"),
            "{v}"
        );
    }

    let approver = api.token("carol", &["approve", "read"]);
    let (s, open) = get(&api, &format!("/v1/approvals?run={run}"), &approver).await;
    assert_eq!(s, StatusCode::OK, "{open}");
    let request = open[0].clone();
    assert_eq!(request["args"]["amount"], json!(150), "{open}");
    let (s, v) = post(
        &api,
        &format!(
            "/v1/approvals/{}/grant",
            request["approval_id"].as_str().unwrap()
        ),
        &approver,
        json!({}),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    wait_for("the run to end", LONG, POLL, || async {
        api.store
            .run(run)
            .await
            .is_ok_and(|r| r.status == "terminal")
    })
    .await;

    let row = api.store.run(run).await.unwrap();
    assert_eq!(row.state, "DONE", "{:?}", row.terminal_reason);
    let history = api.store.history(run).await.unwrap();
    assert!(
        history
            .iter()
            .all(|e| e.payload["call_id"] != "forged-call"),
        "a forged event is in the log"
    );
    let dispatched: Vec<_> = history
        .iter()
        .filter(|e| e.kind == "ACTION_DISPATCHED")
        .collect();
    assert_eq!(
        dispatched.len(),
        1,
        "the approved refund was dispatched once"
    );
    assert_eq!(dispatched[0].payload["action_hash"], request["action_hash"]);
    let result = history
        .iter()
        .find(|e| e.kind == "TOOL_SUCCEEDED")
        .expect("the refund's result");
    assert_eq!(result.payload["call_id"], dispatched[0].payload["call_id"]);
    assert_eq!(
        result.worker, "senders-w1",
        "written by the worker that dispatched it"
    );
    assert_eq!(result.sender, None);
    let applied: i64 =
        sqlx::query_scalar("SELECT count(*) FROM rein_sim_effects WHERE run_id = $1")
            .bind(run)
            .fetch_one(api.store.pool())
            .await
            .unwrap();
    assert_eq!(applied, 1, "the approved refund ran once");
    let out = db(&api, &["runs", "verify", &run.to_string()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

/// An approval sent as an event (research-agent's APPROVED while it waits in
/// WAITING_APPROVAL) needs the approve scope, through the API and through `rein send`; the
/// approver recorded is the token's subject, whoever the payload names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_event_needs_the_approve_scope_and_records_the_token_subject() {
    let api = Api::start("senders_approver", &[]).await;
    let run = run_of(&api.store, "research-agent", json!({})).await;
    common::as_the_engine(
        &api.store,
        run,
        &["TASK_ACCEPTED", "PLAN_READY", "APPROVAL_REQUIRED"],
    )
    .await;
    assert_eq!(api.store.run(run).await.unwrap().state, "WAITING_APPROVAL");
    let claimed = json!({ "type": "APPROVED", "payload": {
        "approver": "cfo@example.com", "comment": "fine by me",
        "data": { "last_approval": { "approver": "cfo@example.com", "granted": true } } } });

    let mallory = api.token("mallory", &["operate", "read"]);
    let (s, v) = send_event(&api, run, &mallory, claimed.clone()).await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    assert_eq!(v["error"]["details"]["required_scope"], "approve");
    assert_eq!(v["error"]["details"]["event"], "APPROVED");
    let out = via_api(
        &api,
        &mallory,
        &[
            "send",
            &run.to_string(),
            "APPROVED",
            "--as",
            "cfo@example.com",
            "--payload",
            r#"{"approver":"cfo@example.com"}"#,
        ],
    );
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(stderr(&out).contains("approve scope"), "{}", stderr(&out));
    let row = api.store.run(run).await.unwrap();
    assert_eq!(
        (row.state.as_str(), row.last_sequence),
        ("WAITING_APPROVAL", 3)
    );
    assert!(api.store.inbox(run).await.unwrap().is_empty());

    let alice = api.token("alice", &["operate", "approve"]);
    let (s, v) = send_event(&api, run, &alice, claimed).await;
    assert_eq!(
        (s, v["outcome"].as_str()),
        (StatusCode::OK, Some("applied")),
        "{v}"
    );
    let approval = logged(&api.store, run, "APPROVED").await;
    assert_eq!(approval.sender.as_deref(), Some("api:alice"));
    assert_eq!(
        approval.payload["approver"], "alice",
        "{}",
        approval.payload
    );
    assert_eq!(approval.payload["comment"], "fine by me");
    let row = api.store.run(run).await.unwrap();
    assert_eq!(row.state, "ACTING");
    assert_eq!(row.projection.data["last_approval"]["approver"], "alice");
}

/// An approval queued while a worker holds the run is applied later by whoever holds it
/// then; the log names the approver who sent it, not the process that applied it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_applied_from_the_inbox_records_who_sent_it() {
    let mut api = Api::start("senders_inbox", &[]).await;
    let run = run_of(
        &api.store,
        "lifecycle",
        json!({ "sim": { "approval": "grant", "work_ms": 2000 } }),
    )
    .await;
    api.fleet.spawn_worker("inbox-w1", "10000");
    api.fleet
        .spawn("inbox-s1", &["scheduler", "--tick-ms", "50"]);
    wait_for(
        "the run to be worked on in `running`",
        LONG,
        POLL,
        || async {
            api.store
                .run(run)
                .await
                .is_ok_and(|r| r.state == "running" && r.lease_live)
        },
    )
    .await;

    // An approval event needs the approve scope (SPEC Z3).
    let operate_only = api.token("ops", &["operate"]);
    let (s, v) = send_event(
        &api,
        run,
        &operate_only,
        json!({ "type": "approval_granted" }),
    )
    .await;
    assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "forbidden"), "{v}");
    assert_eq!(v["error"]["details"]["required_scope"], "approve");

    let alice = api.token("alice", &["operate", "approve"]);
    let (s, v) = send_event(&api, run, &alice, json!({ "type": "approval_granted" })).await;
    assert_eq!(
        (s, v["outcome"].as_str()),
        (StatusCode::ACCEPTED, Some("queued")),
        "{v}"
    );
    wait_for("the run to finish", LONG, POLL, || async {
        api.store.run(run).await.is_ok_and(|r| r.state == "done")
    })
    .await;

    let approval = logged(&api.store, run, "approval_granted").await;
    assert_eq!(approval.sender.as_deref(), Some("api:alice"));
    assert!(
        ["inbox-w1", "inbox-s1"].contains(&approval.worker.as_str()),
        "applied by the lease holder or the scheduler, not written by the API: {}",
        approval.worker
    );
    let out = db(&api, &["runs", "history", &run.to_string(), "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let shown: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let shown = shown
        .as_array()
        .and_then(|a| a.iter().find(|e| e["type"] == "approval_granted"))
        .cloned()
        .expect("in the history");
    assert_eq!(shown["sender"], "api:alice");
    let out = db(&api, &["runs", "history", &run.to_string()]);
    let line = stdout(&out)
        .lines()
        .find(|l| l.contains("approval_granted"))
        .unwrap_or_default()
        .to_owned();
    assert!(line.contains("api:alice"), "{}", stdout(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_repeated_with_its_key_is_applied_once() {
    let api = Api::start("senders_send_key", &[]).await;
    let token = api.token("alice", &["operate"]);
    let waiting_user = || async {
        let run = run_of(&api.store, "research-agent", json!({})).await;
        common::as_the_engine(&api.store, run, &["NEED_CLARIFICATION"]).await;
        run
    };

    // The API: the Idempotency-Key header.
    let run = waiting_user().await;
    let reply = json!({ "type": "USER_REPLY", "payload": { "data": { "answer": "42" } } });
    let path = format!("/v1/runs/{run}/events");
    let (s, first) = post(&api, &path, &token, reply.clone(), Some("reply-1")).await;
    assert_eq!(
        (s, first["sequence"].as_i64()),
        (StatusCode::OK, Some(2)),
        "{first}"
    );
    // Applied, the run went on to PLANNING; the repeat returns the first result.
    let (s, again) = post(&api, &path, &token, reply, Some("reply-1")).await;
    assert_eq!((s, &again), (StatusCode::OK, &first));
    let other = json!({ "type": "USER_REPLY", "payload": { "data": { "answer": "43" } } });
    let (s, v) = post(&api, &path, &token, other, Some("reply-1")).await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "conflict"), "{v}");
    assert_eq!(v["error"]["details"]["idempotency_key"], "reply-1");
    let replies = |run: Uuid| {
        let store = api.store.clone();
        async move {
            store
                .history(run)
                .await
                .unwrap()
                .iter()
                .filter(|e| e.kind == "USER_REPLY")
                .count()
        }
    };
    assert_eq!(replies(run).await, 1);

    // The served document says so.
    let (_, doc) = get(&api, "/openapi.json", &token).await;
    let params = &doc["paths"]["/v1/runs/{id}/events"]["post"]["parameters"];
    assert!(
        params.as_array().is_some_and(|p| p
            .iter()
            .any(|p| p["name"] == "Idempotency-Key" && p["in"] == "header")),
        "{params}"
    );

    // The CLI: --key, on the database and through the API.
    for (route, through_api) in [("db", false), ("api", true)] {
        let run = waiting_user().await.to_string();
        let args = [
            "send",
            run.as_str(),
            "USER_REPLY",
            "--key",
            "cli-1",
            "--json",
        ];
        let send = || {
            if through_api {
                via_api(&api, &token, &args)
            } else {
                db(&api, &args)
            }
        };
        let (first, again) = (send(), send());
        assert_eq!(first.status.code(), Some(0), "{route}: {}", stderr(&first));
        assert_eq!(again.status.code(), Some(0), "{route}: {}", stderr(&again));
        assert_eq!(stdout(&first), stdout(&again), "{route}");
        assert_eq!(replies(run.parse().unwrap()).await, 1, "{route}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_key_stands_for_one_request_of_one_caller() {
    let api = Api::start("senders_enqueue_key", &[]).await;
    let alice = api.token("alice", &["enqueue"]);
    let bob = api.token("bob", &["enqueue"]);
    let body = json!({ "definition": "lifecycle", "input": { "order": 1 } });
    let (s, first) = post(&api, "/v1/runs", &alice, body.clone(), Some("order-1")).await;
    assert_eq!(
        (s, first["created"].as_bool()),
        (StatusCode::CREATED, Some(true)),
        "{first}"
    );
    let (s, again) = post(&api, "/v1/runs", &alice, body.clone(), Some("order-1")).await;
    assert_eq!(s, StatusCode::OK, "{again}");
    assert_eq!(again["run_id"], first["run_id"]);

    let other = json!({ "definition": "lifecycle", "input": { "order": 2 } });
    let (s, v) = post(&api, "/v1/runs", &alice, other, Some("order-1")).await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "conflict"), "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("order-1"),
        "{v}"
    );
    assert_eq!(v["error"]["details"]["idempotency_key"], "order-1");
    let out = via_api(
        &api,
        &alice,
        &[
            "enqueue",
            "--definition",
            "research-agent",
            "--key",
            "order-1",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("order-1"), "{}", stderr(&out));

    // Bob's `order-1` is his own: a run of his, not alice's id.
    let (s, theirs) = post(&api, "/v1/runs", &bob, body, Some("order-1")).await;
    assert_eq!(s, StatusCode::CREATED, "{theirs}");
    assert_ne!(theirs["run_id"], first["run_id"]);

    // A key stored before keys had callers keeps returning its run.
    let old = run_of(&api.store, "lifecycle", json!({})).await;
    sqlx::query("INSERT INTO rein_enqueue_keys (client_key, run_id) VALUES ('from-before', $1)")
        .bind(old)
        .execute(api.store.pool())
        .await
        .unwrap();
    let (s, v) = post(
        &api,
        "/v1/runs",
        &alice,
        json!({ "definition": "lifecycle" }),
        Some("from-before"),
    )
    .await;
    assert_eq!(
        (s, v["run_id"].as_str()),
        (StatusCode::OK, Some(old.to_string().as_str()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_with_a_nul_character_is_refused_by_name() {
    let api = Api::start("senders_nul", &[]).await;
    let token = api.token("alice", &["admin"]);
    let field = |v: &Value| {
        v["error"]["details"]["field"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    };

    for (body, want) in [
        (json!({ "definition": "x\u{0}y" }), "definition"),
        (
            json!({ "definition": "lifecycle", "queue": "q\u{0}" }),
            "queue",
        ),
        (
            json!({ "definition": "lifecycle", "input": { "note": "a\u{0}b" } }),
            "input.note",
        ),
    ] {
        let (s, v) = post(&api, "/v1/runs", &token, body, None).await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
            "{v}"
        );
        assert_eq!(field(&v), want, "{v}");
    }

    let run = run_of(&api.store, "research-agent", json!({})).await;
    common::as_the_engine(&api.store, run, &["NEED_CLARIFICATION"]).await;
    for (body, want) in [
        (json!({ "type": "USER_\u{0}REPLY" }), "type"),
        (
            json!({ "type": "USER_REPLY", "payload": { "data": { "answer": ["ok", "\u{0}"] } } }),
            "payload.data.answer[1]",
        ),
        (
            json!({ "type": "USER_REPLY", "payload": { "k\u{0}": 1 } }),
            "payload.k\\u0000 (a key)",
        ),
    ] {
        let (s, v) = send_event(&api, run, &token, body).await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
            "{v}"
        );
        assert_eq!(field(&v), want, "{v}");
    }

    common::as_the_engine(
        &api.store,
        run,
        &["USER_REPLY", "PLAN_READY", "APPROVAL_REQUIRED"],
    )
    .await;
    let approval = common::ask_refund_approval(
        &api.store,
        run,
        json!({ "order_id": "N1", "amount": 500 }),
        "h-nul",
    )
    .await;
    let (s, v) = post(
        &api,
        &format!("/v1/approvals/{approval}/grant"),
        &token,
        json!({ "comment": "fine\u{0}" }),
        None,
    )
    .await;
    assert_eq!(
        (s, field(&v)),
        (StatusCode::UNPROCESSABLE_ENTITY, "comment".to_owned()),
        "{v}"
    );
    assert!(
        api.store.approval(approval).await.unwrap().open,
        "still undecided"
    );

    for (path, want) in [
        ("/v1/runs?status=a%00b", "status"),
        ("/v1/definitions/x%00y", "path"),
    ] {
        let (s, v) = get(&api, path, &token).await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::UNPROCESSABLE_ENTITY, "validation_failed"),
            "{path}: {v}"
        );
        assert_eq!(field(&v), want, "{path}: {v}");
    }
    let mut spec = api
        .store
        .load_definition("lifecycle", None)
        .await
        .unwrap()
        .spec()
        .clone();
    spec.version = 7;
    spec.description = "a\u{0}b".into();
    let (s, v) = post(
        &api,
        "/v1/definitions",
        &token,
        serde_json::to_value(&spec).unwrap(),
        None,
    )
    .await;
    assert_eq!(
        (s, field(&v)),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            "definition.description".to_owned()
        ),
        "{v}"
    );

    // The CLI refuses the same, exit 1, on the database and through the API.
    let input = r#"{"note": "a\u0000b"}"#;
    let run_s = run.to_string();
    for out in [
        db(
            &api,
            &["enqueue", "--definition", "lifecycle", "--input", input],
        ),
        via_api(
            &api,
            &token,
            &["enqueue", "--definition", "lifecycle", "--input", input],
        ),
        db(&api, &["send", &run_s, "CANCEL", "--payload", input]),
        via_api(
            &api,
            &token,
            &["send", &run_s, "CANCEL", "--payload", input],
        ),
    ] {
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        assert!(stderr(&out).contains("NUL"), "{}", stderr(&out));
    }
    let runs: i64 = sqlx::query_scalar("SELECT count(*) FROM rein_runs")
        .fetch_one(api.store.pool())
        .await
        .unwrap();
    assert_eq!(runs, 1, "nothing was enqueued");
}
