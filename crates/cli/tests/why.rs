//! `rein why RUN` against real PostgreSQL. Each test puts one research-agent run in one
//! situation by sending it events (a run without a lease applies them at once), claiming it,
//! or moving a lease deadline into the past, then asks `rein why` what the run waits for.

use crate::common;

use common::{fresh_store, rein, stderr, stdout};
use rein_store::{ApprovalAsk, EnqueueRequest, SendOutcome, Sender, Store};
use serde_json::{Value, json};
use uuid::Uuid;

/// A new research-agent run on the `default` queue, in INTAKE.
async fn new_run(store: &Store) -> Uuid {
    let def = store
        .load_definition("research-agent", None)
        .await
        .expect("the built-in research-agent");
    store
        .enqueue(EnqueueRequest::new(def, json!({})))
        .await
        .expect("enqueue")
        .run_id
}

/// Commits `events` to an unleased run, each at once.
async fn drive(store: &Store, run: Uuid, events: &[(&str, Value)]) {
    for (kind, payload) in events {
        let outcome = store
            .send(
                run,
                kind,
                payload.clone(),
                &Sender::Engine("test".into()),
                60_000,
            )
            .await
            .unwrap_or_else(|e| panic!("send {kind}: {e}"));
        assert!(
            matches!(outcome, SendOutcome::Applied { .. }),
            "{kind} is applied at once: {outcome:?}"
        );
    }
}

/// A run in ACTING, the state that calls tools.
async fn acting_run(store: &Store) -> Uuid {
    let run = new_run(store).await;
    drive(
        store,
        run,
        &[("TASK_ACCEPTED", json!({})), ("PLAN_READY", json!({}))],
    )
    .await;
    run
}

/// `rein why RUN --json`: must exit 0 and print one object.
fn why_json(url: &str, run: Uuid) -> Value {
    let out = rein(&["why", &run.to_string(), "--json", "--database-url", url]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "rein why --json: {}",
        stderr(&out)
    );
    serde_json::from_str(&stdout(&out))
        .unwrap_or_else(|e| panic!("rein why --json prints JSON ({e}): {}", stdout(&out)))
}

/// `rein why RUN`: must exit 0; returns the verdict line (the last one).
fn why_verdict_line(url: &str, run: Uuid) -> String {
    let out = rein(&["why", &run.to_string(), "--database-url", url]);
    assert_eq!(out.status.code(), Some(0), "rein why: {}", stderr(&out));
    let text = stdout(&out);
    for label in [
        "state",
        "last event",
        "lease",
        "pending",
        "effects",
        "timer",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(label)),
            "the human output has a `{label}` line: {text}"
        );
    }
    let last = text.lines().last().unwrap_or_default().to_owned();
    assert!(
        last.starts_with("waiting for: ") && last.contains(" / what would move it: "),
        "the human output ends with the waiting-for line: {text}"
    );
    last
}

fn text<'v>(v: &'v Value, pointer: &str) -> &'v str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("{pointer} is a string in {v}"))
}

fn number(v: &Value, pointer: &str) -> f64 {
    v.pointer(pointer)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{pointer} is a number in {v}"))
}

#[tokio::test]
async fn run_waiting_for_approval_names_the_request_and_how_to_decide_it() {
    let (url, store) = fresh_store("why_approval").await;
    let run = acting_run(&store).await;
    let args = json!({"order_id": "A1", "amount": 150});
    let approval = store
        .request_approval(ApprovalAsk {
            run_id: run,
            node: "ACTING",
            tool: "refund",
            args: &args,
            action_hash: "refund-A1-150",
            risk: "high",
            expires_after_ms: 3_600_000,
        })
        .await
        .expect("request an approval")
        .approval_id;
    drive(
        &store,
        run,
        &[(
            "APPROVAL_REQUIRED",
            json!({"tool": "refund", "args": args, "approval_id": approval}),
        )],
    )
    .await;

    let why = why_json(&url, run);
    assert_eq!(text(&why, "/state"), "WAITING_APPROVAL");
    assert_eq!(text(&why, "/status"), "parked");
    assert_eq!(text(&why, "/last_event/type"), "APPROVAL_REQUIRED");
    assert_eq!(number(&why, "/last_event/sequence"), 3.0);
    assert_eq!(text(&why, "/last_event/worker"), "test");
    assert!(why["lease"].is_null(), "no lease: {why}");
    assert_eq!(text(&why, "/approvals/0/approval_id"), approval.to_string());
    assert_eq!(text(&why, "/approvals/0/tool"), "refund");
    assert_eq!(why["approvals"][0]["args"], args);
    let expires_in_ms = number(&why, "/approvals/0/expires_in_ms");
    assert!(
        expires_in_ms > 3_000_000.0 && expires_in_ms <= 3_600_000.0,
        "expires in about an hour: {expires_in_ms}"
    );
    assert!(
        number(&why, "/timer/due_in_ms") > 0.0,
        "the reminder timer is ahead: {why}"
    );
    assert!(text(&why, "/waiting_for").contains(&format!("decide approval {approval}")));
    assert!(
        text(&why, "/next_step").contains(&format!("rein approve {approval} --as NAME")),
        "{why}"
    );

    let line = why_verdict_line(&url, run);
    assert!(line.contains(&approval.to_string()), "{line}");
    assert!(line.contains("rein approve"), "{line}");
    assert!(line.contains("it expires in 59m"), "{line}");
}

#[tokio::test]
async fn terminal_run_says_nothing_will_move_it_and_why_it_ended() {
    let (url, store) = fresh_store("why_terminal").await;
    let run = new_run(&store).await;
    drive(
        &store,
        run,
        &[(
            "INVALID_INPUT",
            json!({"reason": "the order id is missing"}),
        )],
    )
    .await;

    let why = why_json(&url, run);
    assert_eq!(text(&why, "/state"), "FAILED");
    assert_eq!(text(&why, "/status"), "terminal");
    assert_eq!(text(&why, "/terminal_reason"), "the order id is missing");
    assert!(why["timer"].is_null() && why["lease"].is_null(), "{why}");
    assert!(
        text(&why, "/waiting_for").contains("terminal (FAILED), reason: the order id is missing"),
        "{why}"
    );
    assert!(text(&why, "/next_step").contains("nothing will move it"));

    let line = why_verdict_line(&url, run);
    assert!(line.contains("terminal (FAILED)"), "{line}");
    assert!(line.contains("nothing will move it"), "{line}");
}

#[tokio::test]
async fn run_in_retry_wait_names_its_timer_and_the_scheduler() {
    let (url, store) = fresh_store("why_retry").await;
    let run = acting_run(&store).await;
    // The server asked to be called again in a minute, so the timer is well ahead.
    drive(
        &store,
        run,
        &[(
            "TOOL_RETRYABLE_FAILED",
            json!({"error": {"class": "transient", "status": 429, "retry_after_ms": 60_000}}),
        )],
    )
    .await;

    let why = why_json(&url, run);
    assert_eq!(text(&why, "/state"), "RETRY_WAIT");
    assert_eq!(text(&why, "/status"), "parked");
    let due_in_ms = number(&why, "/timer/due_in_ms");
    assert!(
        due_in_ms > 30_000.0 && due_in_ms <= 60_000.0,
        "due in about a minute: {due_in_ms}"
    );
    assert!(
        text(&why, "/waiting_for").starts_with("its retry timer (due in "),
        "{why}"
    );
    assert!(text(&why, "/next_step").contains("the scheduler fires it: RETRY_DUE"));

    let line = why_verdict_line(&url, run);
    assert!(line.contains("retry timer (due in"), "{line}");
    assert!(line.contains("scheduler"), "{line}");
}

#[tokio::test]
async fn leased_run_names_the_lease_holder_and_its_token() {
    let (url, store) = fresh_store("why_leased").await;
    let run = acting_run(&store).await;
    let claimed = store
        .claim("worker-why", 1, 60_000, &["default".to_owned()])
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].run_id, run);

    let why = why_json(&url, run);
    assert_eq!(text(&why, "/state"), "ACTING");
    assert_eq!(text(&why, "/lease/worker"), "worker-why");
    assert_eq!(why["lease"]["live"], json!(true));
    assert_eq!(number(&why, "/lease/token"), claimed[0].token as f64);
    let left_ms = number(&why, "/lease/left_ms");
    assert!(
        left_ms > 0.0 && left_ms <= 60_000.0,
        "the lease runs for up to a minute: {left_ms}"
    );
    let waiting_for = text(&why, "/waiting_for");
    assert!(waiting_for.contains("worker worker-why"), "{waiting_for}");
    assert!(
        waiting_for.contains("executing node ACTING"),
        "{waiting_for}"
    );

    let line = why_verdict_line(&url, run);
    assert!(line.contains("worker-why"), "{line}");
}

#[tokio::test]
async fn expired_lease_says_the_scheduler_will_recover_the_run() {
    let (url, store) = fresh_store("why_expired").await;
    let run = acting_run(&store).await;
    let claimed = store
        .claim("worker-gone", 1, 60_000, &["default".to_owned()])
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1);
    // The holder died 4 s ago, as far as the database clock is concerned.
    sqlx::query(
        "UPDATE rein_runs SET lease_until = clock_timestamp() - interval '4 seconds'
         WHERE run_id = $1",
    )
    .bind(run)
    .execute(store.pool())
    .await
    .expect("expire the lease");

    let why = why_json(&url, run);
    assert_eq!(text(&why, "/lease/worker"), "worker-gone");
    assert_eq!(why["lease"]["live"], json!(false));
    assert!(
        number(&why, "/lease/left_ms") <= -4_000.0,
        "expired at least 4 s ago: {why}"
    );
    assert!(text(&why, "/waiting_for").contains("expired"), "{why}");
    assert!(
        text(&why, "/next_step").contains("the scheduler will recover it"),
        "{why}"
    );

    let line = why_verdict_line(&url, run);
    assert!(line.contains("the scheduler will recover it"), "{line}");
}

#[tokio::test]
async fn run_needing_an_operator_gives_the_reason() {
    let (url, store) = fresh_store("why_operator").await;
    let run = new_run(&store).await;
    let reason = "the intake node answered with an event no state accepts";
    drive(
        &store,
        run,
        &[("OPERATOR_REQUIRED", json!({"reason": reason}))],
    )
    .await;

    let why = why_json(&url, run);
    assert_eq!(text(&why, "/status"), "needs_operator");
    assert_eq!(why["needs_operator"], json!(true));
    assert_eq!(text(&why, "/operator_reason"), reason);
    let waiting_for = text(&why, "/waiting_for");
    assert!(waiting_for.contains("needs an operator"), "{waiting_for}");
    assert!(waiting_for.contains(reason), "{waiting_for}");
    assert!(text(&why, "/next_step").contains(&format!("rein send {run} CANCEL")));

    let line = why_verdict_line(&url, run);
    assert!(line.contains("needs an operator"), "{line}");
    assert!(line.contains(reason), "{line}");
}

#[tokio::test]
async fn in_doubt_call_shows_its_ledger_row_and_how_to_resolve_it() {
    let (url, store) = fresh_store("why_in_doubt").await;
    let run = acting_run(&store).await;
    drive(
        &store,
        run,
        &[
            (
                "ACTION_DISPATCHED",
                json!({"action_id": "step-1", "call_id": "call-1", "node": "ACTING", "step": 1,
                       "idempotency_key": "key-1", "tool": "refund"}),
            ),
            (
                "ACTION_RESULT_IN_DOUBT",
                json!({"call_id": "call-1", "reason": "timed out after the request was sent"}),
            ),
            (
                "OPERATOR_REQUIRED",
                json!({"call_id": "call-1", "reason": "refund has no reconcile hook"}),
            ),
        ],
    )
    .await;

    let why = why_json(&url, run);
    assert_eq!(text(&why, "/status"), "needs_operator");
    assert_eq!(text(&why, "/pending_action/status"), "IN_DOUBT");
    assert_eq!(text(&why, "/pending_action/tool"), "refund");
    assert_eq!(text(&why, "/pending_action/call_id"), "call-1");
    assert_eq!(text(&why, "/pending_action/idempotency_key"), "key-1");
    assert_eq!(text(&why, "/pending_action/ledger/status"), "IN_DOUBT");
    assert_eq!(text(&why, "/effects/actions/0/action_id"), "step-1");
    assert_eq!(why["effects"]["sim"], json!([]));
    let waiting_for = text(&why, "/waiting_for");
    assert!(
        waiting_for.contains("refund call call-1 is in doubt"),
        "{waiting_for}"
    );
    assert!(
        waiting_for.contains("refund has no reconcile hook"),
        "{waiting_for}"
    );
    let next_step = text(&why, "/next_step");
    assert!(
        next_step.contains(&format!(
            "rein resolve {run} applied --event TOOL_SUCCEEDED"
        )),
        "{next_step}"
    );
    assert!(
        next_step.contains(&format!("rein resolve {run} not-applied --as NAME")),
        "{next_step}"
    );

    let line = why_verdict_line(&url, run);
    assert!(line.contains("rein resolve"), "{line}");
}

#[tokio::test]
async fn rejected_decision_is_shown_with_its_step_and_reason() {
    let (url, store) = fresh_store("why_rejected").await;
    let run = acting_run(&store).await;
    let reason = "args.amount: -5 is less than the minimum of 0";
    drive(
        &store,
        run,
        &[(
            "DECISION_REJECTED",
            json!({"step": "schema", "reason": reason}),
        )],
    )
    .await;

    let why = why_json(&url, run);
    assert_eq!(text(&why, "/last_rejection/step"), "schema");
    assert_eq!(text(&why, "/last_rejection/reason"), reason);
    assert_eq!(number(&why, "/last_rejection/sequence"), 3.0);
    assert_eq!(why["needs_operator"], json!(false));

    // What the worker commits right after a rejection when the state names no event for it.
    drive(
        &store,
        run,
        &[(
            "OPERATOR_REQUIRED",
            json!({"reason": format!("the model's decision failed at `schema`: {reason}")}),
        )],
    )
    .await;
    let why = why_json(&url, run);
    assert_eq!(text(&why, "/status"), "needs_operator");
    let waiting_for = text(&why, "/waiting_for");
    assert!(
        waiting_for.contains(&format!("rejected decision at step `schema`: {reason}")),
        "{waiting_for}"
    );
    assert!(
        waiting_for.contains("waits for an operator"),
        "{waiting_for}"
    );

    let out = rein(&["why", &run.to_string(), "--database-url", &url]);
    let human = stdout(&out);
    assert!(
        human
            .lines()
            .any(|l| l.starts_with("rejected") && l.contains("`schema`")),
        "{human}"
    );
    let line = why_verdict_line(&url, run);
    assert!(
        line.contains("rejected decision at step `schema`"),
        "{line}"
    );
}

#[tokio::test]
async fn runnable_unleased_run_waits_for_a_worker_on_its_queue() {
    let (url, store) = fresh_store("why_runnable").await;
    let run = new_run(&store).await;

    let why = why_json(&url, run);
    assert_eq!(text(&why, "/status"), "runnable");
    assert!(why["last_event"].is_null(), "no event yet: {why}");
    assert!(why["pending_action"].is_null(), "{why}");
    assert_eq!(number(&why, "/fleet/workers"), 0.0);
    assert!(
        text(&why, "/waiting_for").contains("is a worker running on queue default?"),
        "{why}"
    );
}

#[tokio::test]
async fn unknown_run_is_an_input_error_like_runs_show() {
    let (url, _store) = fresh_store("why_unknown").await;
    let missing = Uuid::now_v7();
    let out = rein(&["why", &missing.to_string(), "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("run {missing} not found")),
        "{}",
        stderr(&out)
    );
    assert!(
        stdout(&out).is_empty(),
        "nothing on stdout: {}",
        stdout(&out)
    );
}

#[tokio::test]
async fn finished_sim_run_lists_its_ledger_and_applied_effects() {
    let fixture = common::finished_runs("why_sim").await;
    let run = fixture.done[0];

    let why = why_json(&fixture.url, run);
    assert_eq!(text(&why, "/status"), "terminal");
    let actions = why["effects"]["actions"].as_array().expect("ledger rows");
    assert!(
        !actions.is_empty(),
        "the side effect has a ledger row: {why}"
    );
    assert!(
        actions.iter().all(|a| a["status"] == "SUCCEEDED"),
        "every action of a completed run succeeded: {why}"
    );
    let sim = why["effects"]["sim"].as_array().expect("sim effect rows");
    assert!(!sim.is_empty(), "the sim ledger applied its effect: {why}");
    for effect in sim {
        assert!(
            actions
                .iter()
                .any(|a| a["idempotency_key"] == effect["idempotency_key"]),
            "each applied effect carries a dispatched action's key: {why}"
        );
    }
    let line = why_verdict_line(&fixture.url, run);
    assert!(line.contains("nothing will move it"), "{line}");
}

/// The transition of `why`'s `transitions_out` for `event`.
fn way_out<'v>(why: &'v Value, event: &str) -> &'v Value {
    why["transitions_out"]
        .as_array()
        .and_then(|list| list.iter().find(|t| t["event"] == event))
        .unwrap_or_else(|| panic!("a transition for {event} in {why}"))
}

#[tokio::test]
async fn the_guards_of_the_ways_out_show_which_one_blocks_with_its_value() {
    let (url, store) = fresh_store("why_guards").await;
    let run = acting_run(&store).await;
    drive(&store, run, &[("TOOL_RETRYABLE_FAILED", json!({}))]).await;

    // Attempt 0 of 3: a retry is allowed.
    let why = why_json(&url, run);
    assert_eq!(text(&why, "/state"), "RETRY_WAIT");
    let due = way_out(&why, "RETRY_DUE");
    assert_eq!(due["to"], "ACTING");
    assert_eq!(due["guards"][0]["name"], "attempts_left");
    assert_eq!(due["guards"][0]["expr"], "run.attempt < retry.max_retries");
    assert_eq!(due["guards"][0]["value"], "true");
    assert_eq!(due["chosen"], true);
    let exhausted = way_out(&why, "RETRY_EXHAUSTED");
    assert_eq!(
        (exhausted["to"].as_str(), exhausted["chosen"].as_bool()),
        (Some("FAILED"), Some(true))
    );
    assert_eq!(exhausted["guards"], json!([]));

    // Three retries later the guard blocks the way back to ACTING.
    for _ in 0..3 {
        drive(
            &store,
            run,
            &[
                ("RETRY_DUE", json!({})),
                ("TOOL_RETRYABLE_FAILED", json!({})),
            ],
        )
        .await;
    }
    let why = why_json(&url, run);
    assert_eq!(number(&why, "/attempt"), 3.0);
    let due = way_out(&why, "RETRY_DUE");
    assert_eq!(due["guards"][0]["value"], "false");
    assert_eq!(
        (due["holds"].as_bool(), due["chosen"].as_bool()),
        (Some(false), Some(false))
    );
    assert_eq!(due["guards"][0]["reads_event"], false);

    let out = rein(&["why", &run.to_string(), "--database-url", &url]);
    let human = stdout(&out);
    assert!(
        human.contains("RETRY_DUE -> ACTING: blocked; business `attempts_left` = false"),
        "{human}"
    );
    assert!(
        human.contains("RETRY_EXHAUSTED -> FAILED: fires; no guard"),
        "{human}"
    );
}
