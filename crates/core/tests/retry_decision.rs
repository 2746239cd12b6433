//! The retry decision (SPEC R1, R2, X6, X7): `retry_allowed = retryable(error) AND attempt
//! < max AND elapsed < deadline`, judged by the pure reducer from what the log records, and
//! the failure event the engine commits when an attempt ends without a result.

use rein_core::retry::{Failure, LostAttempt, RetryDecision, RetryPolicy, kind};
use rein_core::{Definition, Event, RejectReason, RunState, apply, builtin, replay, timer};
use serde_json::{Value, json};

fn policy(extra: impl FnOnce(&mut RetryPolicy)) -> RetryPolicy {
    let mut p = RetryPolicy {
        max_retries: 3,
        deadline_ms: Some(10_000),
        ..RetryPolicy::default()
    };
    extra(&mut p);
    p
}

fn error(class: &str, kind: &str) -> Value {
    json!({ "class": class, "kind": kind, "message": "m" })
}

#[test]
fn retryability_follows_class_fine_class_and_the_tools_contract() {
    let p = policy(|p| p.non_retryable = vec!["http_429".into(), "quota_exceeded".into()]);
    assert!(p.retryable(None), "a failure recorded without an error");
    assert!(p.retryable(Some(&error("transient", "http_5xx"))));
    assert!(
        !p.retryable(Some(&error("transient", "http_429"))),
        "fine class named"
    );
    assert!(
        !p.retryable(Some(&error("transient", "quota_exceeded"))),
        "a handler's class"
    );
    assert!(!p.retryable(Some(&error("fatal", "http_4xx"))));
    assert!(!p.retryable(Some(&error("in_doubt", "timeout"))));
    let mut not_retryable = error("transient", "http_5xx");
    not_retryable["retryable"] = json!(false);
    assert!(
        !p.retryable(Some(&not_retryable)),
        "a tool with retryable = false"
    );
    let coarse = policy(|p| p.non_retryable = vec!["transient".into()]);
    assert!(
        !coarse.retryable(Some(&error("transient", "network"))),
        "coarse class named"
    );
}

#[test]
fn decide_is_retryable_and_attempt_below_max_and_elapsed_below_deadline() {
    let p = policy(|_| {});
    let e = error("transient", "timeout");
    assert_eq!(p.decide(Some(&e), 0, Some(0)), RetryDecision::Retry);
    assert_eq!(p.decide(Some(&e), 2, Some(9_999)), RetryDecision::Retry);
    assert_eq!(p.decide(Some(&e), 3, Some(0)), RetryDecision::Exhausted);
    assert_eq!(
        p.decide(Some(&e), 0, Some(10_000)),
        RetryDecision::DeadlinePassed
    );
    assert_eq!(
        p.decide(Some(&e), 0, None),
        RetryDecision::Retry,
        "elapsed not measured"
    );
    let t = policy(|p| p.non_retryable = vec!["timeout".into()]);
    assert_eq!(t.decide(Some(&e), 0, Some(0)), RetryDecision::NotRetryable);
    let no_deadline = policy(|p| p.deadline_ms = None);
    assert_eq!(
        no_deadline.decide(Some(&e), 0, Some(u64::MAX)),
        RetryDecision::Retry
    );
    assert_eq!(RetryDecision::NotRetryable.reason(), "not_retryable");
    assert_eq!(
        RetryDecision::DeadlinePassed.reason(),
        "retry_deadline_passed"
    );
    assert_eq!(RetryDecision::Exhausted.reason(), "retries_exhausted");
}

#[test]
fn http_statuses_get_fine_classes() {
    for (status, fine, class) in [
        (408, "timeout", "transient"),
        (429, "http_429", "transient"),
        (503, "http_5xx", "transient"),
        (500, "http_5xx", "transient"),
        (404, "http_4xx", "fatal"),
        (302, "http_3xx", "fatal"),
    ] {
        let f = Failure::from_http_status(status, Some(2), "x").expect("a failure");
        let json = f.to_json();
        assert_eq!(json["kind"], fine, "{status}");
        assert_eq!(json["class"], class, "{status}");
        assert_eq!(json["status"], status);
    }
    assert!(Failure::from_http_status(204, None, "x").is_none());
    assert_eq!(
        Failure::from_http_status(429, Some(2), "x")
            .unwrap()
            .retry_after_ms(),
        Some(2_000)
    );
    let text = Failure::transient(kind::NETWORK, "a\u{0}b").to_json();
    assert_eq!(text["message"], "a\u{FFFD}b", "engine text never holds NUL");
}

/// `lifecycle` with a policy of its own: 3 retries, a 5 s deadline, `timeout` not retryable.
fn lifecycle_with_policy() -> Definition {
    let text = builtin::LIFECYCLE.replacen(
        "jitter = 0.2\n",
        "jitter = 0.2\ndeadline_ms = 5000\nnon_retryable = [\"timeout\"]\n",
        1,
    );
    Definition::parse(
        &text,
        rein_core::Format::Toml,
        &rein_core::GuardRegistry::new(),
    )
    .expect("parse")
}

/// A lifecycle run waiting in `retrying` after a failure recorded with `error`, at `attempt`.
fn retrying(def: &Definition, attempt: u32, error: Value) -> RunState {
    let mut run = RunState::initial(def, json!({}));
    let events = [
        Event::new(1, "start", json!({})),
        Event::new(2, "transient_error", json!({ "error": error })),
    ];
    run = replay(def, run, events.iter()).expect("planned -> running -> retrying");
    run.attempt = attempt;
    run
}

fn due(run: &RunState, elapsed_ms: u64) -> Event {
    Event::new(
        run.sequence + 1,
        "retry",
        json!({ "retry": { "elapsed_ms": elapsed_ms } }),
    )
}

fn refused_why(def: &Definition, run: &RunState, event: &Event) -> Option<String> {
    match apply(def, run, event) {
        Ok(_) => None,
        Err(e) => match e.reason {
            RejectReason::RetryRefused { why } => Some(why),
            other => panic!("refused for another reason: {other:?}"),
        },
    }
}

#[test]
fn the_reducer_refuses_a_recorded_retry_that_r1_does_not_allow() {
    let def = lifecycle_with_policy();
    let ok = retrying(&def, 0, error("transient", "http_5xx"));
    assert_eq!(refused_why(&def, &ok, &due(&ok, 100)), None);
    assert_eq!(
        refused_why(&def, &ok, &due(&ok, 5_000)).as_deref(),
        Some("retry_deadline_passed")
    );
    let timed_out = retrying(&def, 0, error("transient", "timeout"));
    assert_eq!(
        refused_why(&def, &timed_out, &due(&timed_out, 0)).as_deref(),
        Some("not_retryable")
    );
    let used_up = retrying(&def, 3, error("transient", "http_5xx"));
    assert_eq!(
        refused_why(&def, &used_up, &due(&used_up, 0)).as_deref(),
        Some("retries_exhausted")
    );
}

#[test]
fn a_retry_recorded_without_its_inputs_replays_as_it_always_did() {
    // refund-agent's RETRY_DUE has no guard: logs written before retries were judged by the
    // engine may hold retries past max_retries, with an empty payload. They still replay.
    let def = builtin::refund_agent();
    let mut run = RunState::initial(&def, json!({}));
    let mut seq = 0;
    let mut next = |kind: &str, payload: Value| {
        seq += 1;
        Event::new(seq, kind, payload)
    };
    let mut log = Vec::new();
    for _ in 0..5 {
        log.push(next(
            "TOOL_RETRYABLE_FAILED",
            json!({ "error": error("fatal", "x") }),
        ));
        log.push(next("RETRY_DUE", json!({})));
    }
    run = replay(&def, run, log.iter()).expect("an old log replays");
    assert_eq!(run.attempt, 5);
    assert_eq!(run.state, "ACTING");
}

#[test]
fn the_timer_offers_the_retry_only_when_allowed_and_says_why_not() {
    let def = lifecycle_with_policy();
    let ok = retrying(&def, 0, error("transient", "http_5xx"));
    let fired = timer::fired_events(&def, &ok, 300, 400);
    assert_eq!(fired[0].0, "retry");
    assert_eq!(fired[0].1, json!({ "retry": { "elapsed_ms": 400 } }));
    assert_eq!(fired[1].0, "max_retries_exceeded");
    assert_eq!(fired[1].1["reason"], "retries_exhausted");

    let late = timer::fired_events(&def, &ok, 300, 6_000);
    assert_eq!(late.len(), 1);
    assert_eq!(late[0].0, "max_retries_exceeded");
    assert_eq!(late[0].1["reason"], "retry_deadline_passed");
    assert_eq!(late[0].1["retry"]["elapsed_ms"], 6_000);
}

#[test]
fn a_retry_already_ruled_out_is_not_waited_for() {
    let def = lifecycle_with_policy();
    let ok = retrying(&def, 0, error("transient", "http_5xx"));
    assert!(timer::next_timer(&def, &ok, 0.5).unwrap().after_ms > 0);
    let timed_out = retrying(&def, 0, error("transient", "timeout"));
    assert_eq!(
        timer::next_timer(&def, &timed_out, 0.5).unwrap().after_ms,
        0
    );
    let used_up = retrying(&def, 3, error("transient", "http_5xx"));
    assert_eq!(timer::next_timer(&def, &used_up, 0.5).unwrap().after_ms, 0);
}

/// research-agent's ACTING with a dispatched call that is now in doubt.
fn in_doubt(def: &Definition) -> RunState {
    let run = RunState::initial(def, json!({}));
    let log = [
        Event::new(1, "TASK_ACCEPTED", json!({})),
        Event::new(2, "PLAN_READY", json!({})),
        Event::new(
            3,
            "ACTION_DISPATCHED",
            json!({ "action_id": "step-1", "call_id": "c1", "node": "ACTING", "step": 1,
                    "idempotency_key": "k" }),
        ),
        Event::new(
            4,
            "ACTION_RESULT_IN_DOUBT",
            json!({ "call_id": "c1", "reason": "timed out",
                    "error": Failure::in_doubt(kind::TIMEOUT, "timed out").to_json() }),
        ),
    ];
    replay(def, run, log.iter()).expect("in doubt")
}

#[test]
fn a_call_found_not_applied_is_followed_by_the_states_failure_event() {
    let def = builtin::research_agent();
    let run = in_doubt(&def);
    let slot = run.action.as_ref().expect("the call's slot");
    assert_eq!(slot.lost.as_deref(), Some("timeout"), "why it was lost");
    let record = json!({ "call_id": "c1", "by": "reconcile" });
    let failure = Failure::transient(kind::TIMEOUT, "not applied");
    let (event, payload) = rein_core::retry::lost_attempt_event(
        &def,
        &run,
        ("ACTION_NOT_APPLIED", &record),
        LostAttempt::NotApplied,
        &failure,
    )
    .expect("ACTING declares its failure event");
    assert_eq!(event, "TOOL_RETRYABLE_FAILED");
    assert_eq!(payload["reason"], "not_applied");
    assert_eq!(payload["error"]["kind"], "timeout");
    let log = [
        Event::new(5, "ACTION_NOT_APPLIED", record.clone()),
        Event::new(6, event, payload),
    ];
    let after = replay(&def, run.clone(), log.iter()).expect("both apply");
    assert_eq!(after.state, "RETRY_WAIT", "the definition's retry path");

    // Before the call is settled, the failure event would not be taken.
    assert!(
        rein_core::retry::lost_attempt_event(
            &def,
            &run,
            ("LEASE_EXPIRED", &json!({})),
            LostAttempt::LeaseExpired,
            &failure,
        )
        .is_none(),
        "a call still pending has its own result to come"
    );
    // A state that declares no failure event gets none.
    let refund = builtin::refund_agent();
    let idle = RunState::initial(&refund, json!({}));
    assert!(
        rein_core::retry::lost_attempt_event(
            &refund,
            &idle,
            ("LEASE_EXPIRED", &json!({})),
            LostAttempt::LeaseExpired,
            &failure,
        )
        .is_none()
    );
}

#[test]
fn an_in_doubt_record_without_an_error_reduces_as_before() {
    let def = builtin::research_agent();
    let mut run = in_doubt(&def);
    let slot = run.action.as_mut().unwrap();
    slot.status = rein_core::ActionStatus::Dispatched;
    slot.lost = None;
    let old = Event::new(
        run.sequence + 1,
        "ACTION_RESULT_IN_DOUBT",
        json!({ "call_id": "c1", "reason": "r" }),
    );
    let next = apply(&def, &run, &old).expect("applies");
    let mut expected = run.clone();
    expected.sequence += 1;
    expected.action.as_mut().unwrap().status = rein_core::ActionStatus::InDoubt;
    assert_eq!(next, expected, "nothing but the status changes");
}

#[test]
fn the_first_try_starts_when_an_action_is_first_tried_not_on_its_retries() {
    let def = builtin::lifecycle();
    let planned = RunState::initial(&def, json!({}));
    let running = apply(&def, &planned, &Event::new(1, "start", json!({}))).unwrap();
    assert!(rein_core::retry::starts_first_try(&def, &planned, &running));
    let waiting = apply(&def, &running, &Event::new(2, "transient_error", json!({}))).unwrap();
    assert!(
        !rein_core::retry::starts_first_try(&def, &running, &waiting),
        "parked"
    );
    let retried = apply(&def, &waiting, &Event::new(3, "retry", json!({}))).unwrap();
    assert_eq!(retried.attempt, 1);
    assert!(
        !rein_core::retry::starts_first_try(&def, &waiting, &retried),
        "a retry"
    );
    assert!(
        !rein_core::retry::starts_first_try(&def, &running, &running),
        "no move"
    );
}
