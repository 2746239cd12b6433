//! The `research-agent` definition (SPEC M6, M7, M8, X5): all 11 x 22 (state, event) pairs,
//! its guards, call matching, candidate priority and the engine events.

use rein_core::{
    Definition, Event, GuardKind, InvalidTransition, RejectReason, RunState, apply, builtin, decide,
};
use serde_json::{Value, json};

const STATES: [&str; 11] = [
    "INTAKE",
    "PLANNING",
    "ACTING",
    "OBSERVING",
    "RETRY_WAIT",
    "WAITING_APPROVAL",
    "WAITING_USER",
    "FINALIZING",
    "SUCCEEDED",
    "FAILED",
    "CANCELLED",
];

const EVENTS: [&str; 22] = [
    "TASK_ACCEPTED",
    "NEED_CLARIFICATION",
    "INVALID_INPUT",
    "USER_REPLY",
    "USER_CANCELLED",
    "PLAN_READY",
    "PLAN_FAILED",
    "TOOL_SUCCEEDED",
    "TOOL_RETRYABLE_FAILED",
    "APPROVAL_REQUIRED",
    "TOOL_FATAL_FAILED",
    "RETRY_DUE",
    "RETRY_EXHAUSTED",
    "APPROVED",
    "REJECTED",
    "APPROVAL_TIMEOUT",
    "CONTINUE",
    "TASK_READY",
    "BLOCKED_BY_USER",
    "UNRECOVERABLE",
    "OUTPUT_COMMITTED",
    "OUTPUT_COMMIT_FAILED",
];

/// The state diagram of seed 000 §6.2, hard-coded on purpose: reading it from the
/// definition would prove nothing. (The diagram has 23 edges, counting the
/// WAITING_APPROVAL self-loop.)
const DIAGRAM: [(&str, &str, &str); 23] = [
    ("INTAKE", "TASK_ACCEPTED", "PLANNING"),
    ("INTAKE", "NEED_CLARIFICATION", "WAITING_USER"),
    ("INTAKE", "INVALID_INPUT", "FAILED"),
    ("WAITING_USER", "USER_REPLY", "PLANNING"),
    ("WAITING_USER", "USER_CANCELLED", "CANCELLED"),
    ("PLANNING", "PLAN_READY", "ACTING"),
    ("PLANNING", "NEED_CLARIFICATION", "WAITING_USER"),
    ("PLANNING", "PLAN_FAILED", "FAILED"),
    ("ACTING", "TOOL_SUCCEEDED", "OBSERVING"),
    ("ACTING", "TOOL_RETRYABLE_FAILED", "RETRY_WAIT"),
    ("ACTING", "APPROVAL_REQUIRED", "WAITING_APPROVAL"),
    ("ACTING", "TOOL_FATAL_FAILED", "FAILED"),
    ("RETRY_WAIT", "RETRY_DUE", "ACTING"),
    ("RETRY_WAIT", "RETRY_EXHAUSTED", "FAILED"),
    ("WAITING_APPROVAL", "APPROVED", "ACTING"),
    ("WAITING_APPROVAL", "REJECTED", "CANCELLED"),
    ("WAITING_APPROVAL", "APPROVAL_TIMEOUT", "WAITING_APPROVAL"),
    ("OBSERVING", "CONTINUE", "ACTING"),
    ("OBSERVING", "TASK_READY", "FINALIZING"),
    ("OBSERVING", "BLOCKED_BY_USER", "WAITING_USER"),
    ("OBSERVING", "UNRECOVERABLE", "FAILED"),
    ("FINALIZING", "OUTPUT_COMMITTED", "SUCCEEDED"),
    ("FINALIZING", "OUTPUT_COMMIT_FAILED", "FAILED"),
];

const TERMINAL: [&str; 3] = ["SUCCEEDED", "FAILED", "CANCELLED"];

const RECORD_EVENTS: [&str; 6] = [
    "DECISION_REJECTED",
    "LEASE_EXPIRED",
    "APPROVAL_REQUESTED",
    "APPROVAL_REMINDER",
    "APPROVAL_DECIDED",
    "INBOX_EXPIRED",
];

/// A run in `state` whose guards can all pass: one tool result, no pending call, no retry
/// made yet.
fn run_in(def: &Definition, state: &str) -> RunState {
    let mut run = RunState::initial(def, json!({"question": "q"}));
    run.state = state.to_owned();
    run.sequence = 6;
    run.entered_at_sequence = 6;
    run.results = vec![json!({"call_id": "c0", "step": 1, "node": "ACTING", "value": 1})];
    run.steps_completed = 1;
    run
}

fn next(
    def: &Definition,
    run: &RunState,
    event: &str,
    payload: Value,
) -> Result<RunState, InvalidTransition> {
    apply(def, run, &Event::new(run.sequence + 1, event, payload))
}

fn step(def: &Definition, run: &RunState, event: &str, payload: Value) -> RunState {
    next(def, run, event, payload)
        .unwrap_or_else(|e| panic!("{event} in {} should be accepted: {e}", run.state))
}

fn dispatch_payload(call_id: &str, step: u32) -> Value {
    json!({
        "action_id": format!("act-{step}"),
        "call_id": call_id,
        "node": "ACTING",
        "step": step,
        "idempotency_key": format!("key-{step}"),
    })
}

/// INTAKE -> PLANNING -> ACTING with call `c1` dispatched for step 1.
fn acting_with_pending_call(def: &Definition) -> RunState {
    let run = RunState::initial(def, json!({"question": "q"}));
    let run = step(def, &run, "TASK_ACCEPTED", json!({}));
    let run = step(def, &run, "PLAN_READY", json!({}));
    step(def, &run, "ACTION_DISPATCHED", dispatch_payload("c1", 1))
}

/// ... then the tool succeeded: OBSERVING with one result and no pending call.
fn observing_with_result(def: &Definition) -> RunState {
    let run = acting_with_pending_call(def);
    step(
        def,
        &run,
        "TOOL_SUCCEEDED",
        json!({"call_id": "c1", "result": {"hits": 3}}),
    )
}

fn target(state: &str, event: &str) -> Option<&'static str> {
    DIAGRAM
        .iter()
        .find(|(s, e, _)| *s == state && *e == event)
        .map(|(_, _, to)| *to)
}

fn candidates(events: &[&str]) -> Vec<(String, Value)> {
    events
        .iter()
        .map(|e| ((*e).to_owned(), json!({})))
        .collect()
}

#[test]
fn research_agent_declares_exactly_the_eleven_states_and_twenty_two_events() {
    let def = builtin::research_agent();
    let mut states: Vec<&str> = def.states().map(|s| s.name.as_str()).collect();
    states.sort_unstable();
    let mut expected = STATES.to_vec();
    expected.sort_unstable();
    assert_eq!(states, expected);

    let mut events: Vec<&str> = def.events().map(String::as_str).collect();
    events.sort_unstable();
    let mut expected = EVENTS.to_vec();
    expected.sort_unstable();
    assert_eq!(events, expected);
    assert_eq!(def.initial_state(), "INTAKE");
    assert_eq!(def.cancel_state(), "CANCELLED");
}

#[test]
fn exactly_the_diagram_transitions_are_accepted_with_their_targets() {
    let def = builtin::research_agent();
    let mut accepted = 0;
    let mut rejected = 0;
    for state in STATES {
        for event in EVENTS {
            let run = run_in(&def, state);
            match (target(state, event), next(&def, &run, event, json!({}))) {
                (Some(to), Ok(after)) => {
                    assert_eq!(after.state, to, "{state} + {event}");
                    assert_eq!(after.sequence, run.sequence + 1);
                    accepted += 1;
                }
                (None, Err(_)) => rejected += 1,
                (Some(to), Err(e)) => panic!("{state} + {event} should go to {to}, got {e}"),
                (None, Ok(after)) => {
                    panic!(
                        "{state} + {event} should be rejected, went to {}",
                        after.state
                    )
                }
            }
        }
    }
    assert_eq!(accepted, DIAGRAM.len());
    assert_eq!(rejected, STATES.len() * EVENTS.len() - DIAGRAM.len());
}

#[test]
fn every_pair_outside_the_diagram_is_rejected_as_not_in_table_or_terminal() {
    let def = builtin::research_agent();
    for state in STATES {
        for event in EVENTS {
            if target(state, event).is_some() {
                continue;
            }
            let run = run_in(&def, state);
            let err = next(&def, &run, event, json!({})).expect_err("not in the diagram");
            assert_eq!(err.state, state);
            assert_eq!(err.event, event);
            assert_eq!(err.sequence, run.sequence + 1);
            let expected = if TERMINAL.contains(&state) {
                RejectReason::Terminal
            } else {
                RejectReason::NotInTable
            };
            assert_eq!(err.reason, expected, "{state} + {event}");
        }
    }
}

#[test]
fn retry_due_is_accepted_while_attempt_is_below_max_retries() {
    let def = builtin::research_agent();
    for attempt in 0..3 {
        let mut run = run_in(&def, "RETRY_WAIT");
        run.attempt = attempt;
        let after = step(&def, &run, "RETRY_DUE", json!({}));
        assert_eq!(after.state, "ACTING");
    }
}

#[test]
fn retry_due_increments_attempt() {
    let def = builtin::research_agent();
    let mut run = run_in(&def, "RETRY_WAIT");
    run.attempt = 2;
    assert_eq!(step(&def, &run, "RETRY_DUE", json!({})).attempt, 3);
}

#[test]
fn retry_due_is_rejected_by_its_guard_once_attempts_are_exhausted() {
    let def = builtin::research_agent();
    let mut run = run_in(&def, "RETRY_WAIT");
    run.attempt = 3;
    let err = next(&def, &run, "RETRY_DUE", json!({})).expect_err("exhausted");
    assert_eq!(
        err.reason,
        RejectReason::GuardFailed {
            kind: GuardKind::Business,
            guard: "attempts_left".into()
        }
    );
}

#[test]
fn retry_exhausted_fails_the_run_after_the_last_retry() {
    let def = builtin::research_agent();
    let mut run = run_in(&def, "RETRY_WAIT");
    run.attempt = 3;
    let after = step(&def, &run, "RETRY_EXHAUSTED", json!({}));
    assert_eq!(after.state, "FAILED");
    assert_eq!(after.terminal_reason.as_deref(), Some("RETRY_EXHAUSTED"));
}

#[test]
fn retryable_failure_keeps_the_action_so_the_retry_reuses_its_idempotency_key() {
    let def = builtin::research_agent();
    let run = acting_with_pending_call(&def);
    let run = step(
        &def,
        &run,
        "TOOL_RETRYABLE_FAILED",
        json!({"call_id": "c1"}),
    );
    assert_eq!(run.state, "RETRY_WAIT");
    assert_eq!(run.pending_call(), None);
    let slot = run.action.as_ref().expect("the step stays open");
    assert_eq!(slot.idempotency_key, "key-1");
    assert_eq!(slot.step, 1);
    assert_eq!(run.steps_completed, 0);
    let run = step(&def, &run, "RETRY_DUE", json!({}));
    assert_eq!(run.attempt, 1);
    assert_eq!(
        run.action.as_ref().map(|a| a.action_id.as_str()),
        Some("act-1")
    );
}

#[test]
fn task_ready_needs_at_least_one_result() {
    let def = builtin::research_agent();
    let mut run = run_in(&def, "OBSERVING");
    run.results.clear();
    let err = next(&def, &run, "TASK_READY", json!({})).expect_err("no results");
    assert_eq!(
        err.reason,
        RejectReason::GuardFailed {
            kind: GuardKind::Business,
            guard: "has_results".into()
        }
    );
}

#[test]
fn task_ready_needs_no_pending_call() {
    let def = builtin::research_agent();
    let run = observing_with_result(&def);
    let run = step(&def, &run, "ACTION_DISPATCHED", dispatch_payload("c2", 2));
    assert_eq!(run.pending_call(), Some("c2"));
    assert_eq!(run.results.len(), 1);
    let err = next(&def, &run, "TASK_READY", json!({})).expect_err("pending call");
    assert_eq!(
        err.reason,
        RejectReason::GuardFailed {
            kind: GuardKind::Legality,
            guard: "no_pending_call".into()
        }
    );
}

#[test]
fn task_ready_with_a_result_and_no_pending_call_finalizes() {
    let def = builtin::research_agent();
    let run = observing_with_result(&def);
    assert_eq!(
        step(&def, &run, "TASK_READY", json!({})).state,
        "FINALIZING"
    );
}

#[test]
fn tool_result_naming_another_call_is_a_call_mismatch() {
    let def = builtin::research_agent();
    let run = acting_with_pending_call(&def);
    let err = next(
        &def,
        &run,
        "TOOL_SUCCEEDED",
        json!({"call_id": "c-old", "result": 1}),
    )
    .expect_err("superseded call");
    assert_eq!(
        err.reason,
        RejectReason::CallMismatch {
            pending: Some("c1".into()),
            got: Some("c-old".into())
        }
    );
}

#[test]
fn tool_result_naming_no_call_while_one_is_pending_is_a_call_mismatch() {
    let def = builtin::research_agent();
    let run = acting_with_pending_call(&def);
    let err = next(&def, &run, "TOOL_FATAL_FAILED", json!({})).expect_err("no call id");
    assert_eq!(
        err.reason,
        RejectReason::CallMismatch {
            pending: Some("c1".into()),
            got: None
        }
    );
}

#[test]
fn tool_result_naming_the_pending_call_is_accepted() {
    let def = builtin::research_agent();
    let run = acting_with_pending_call(&def);
    let after = step(
        &def,
        &run,
        "TOOL_SUCCEEDED",
        json!({"call_id": "c1", "result": {"hits": 3}}),
    );
    assert_eq!(after.state, "OBSERVING");
}

#[test]
fn tool_success_appends_the_result_with_its_call_and_step() {
    let def = builtin::research_agent();
    let after = observing_with_result(&def);
    assert_eq!(after.results.len(), 1);
    assert_eq!(after.results[0]["call_id"], "c1");
    assert_eq!(after.results[0]["step"], 1);
    assert_eq!(after.results[0]["node"], "ACTING");
    assert_eq!(after.results[0]["value"], json!({"hits": 3}));
}

#[test]
fn tool_success_clears_the_pending_call_and_completes_the_step() {
    let def = builtin::research_agent();
    let before = acting_with_pending_call(&def);
    assert_eq!(before.steps_completed, 0);
    let after = observing_with_result(&def);
    assert_eq!(after.pending_call(), None);
    assert_eq!(after.action, None);
    assert_eq!(after.steps_completed, 1);
}

#[test]
fn late_result_of_a_call_superseded_by_a_retry_is_rejected() {
    let def = builtin::research_agent();
    let run = acting_with_pending_call(&def);
    let run = step(
        &def,
        &run,
        "TOOL_RETRYABLE_FAILED",
        json!({"call_id": "c1"}),
    );
    let run = step(&def, &run, "RETRY_DUE", json!({}));
    let late = json!({"call_id": "c1", "result": "stale"});
    let err = next(&def, &run, "TOOL_SUCCEEDED", late.clone()).expect_err("c1 was given up");
    assert!(
        matches!(err.reason, RejectReason::CallMismatch { .. }),
        "{err}"
    );

    let run = step(&def, &run, "ACTION_DISPATCHED", dispatch_payload("c2", 1));
    let err = next(&def, &run, "TOOL_SUCCEEDED", late).expect_err("c2 is pending");
    assert_eq!(
        err.reason,
        RejectReason::CallMismatch {
            pending: Some("c2".into()),
            got: Some("c1".into())
        }
    );
}

#[test]
fn tool_success_after_retries_resets_attempt_for_the_next_step() {
    let def = builtin::research_agent();
    let run = acting_with_pending_call(&def);
    let run = step(
        &def,
        &run,
        "TOOL_RETRYABLE_FAILED",
        json!({"call_id": "c1"}),
    );
    let run = step(&def, &run, "RETRY_DUE", json!({}));
    let run = step(&def, &run, "ACTION_DISPATCHED", dispatch_payload("c2", 1));
    assert_eq!(run.attempt, 1);
    let run = step(
        &def,
        &run,
        "TOOL_SUCCEEDED",
        json!({"call_id": "c2", "result": 1}),
    );
    assert_eq!(run.attempt, 0);
    assert_eq!(run.steps_completed, 1);
}

#[test]
fn approval_timeout_is_a_self_loop() {
    let def = builtin::research_agent();
    let run = run_in(&def, "WAITING_APPROVAL");
    let after = step(&def, &run, "APPROVAL_TIMEOUT", json!({}));
    assert_eq!(after.state, "WAITING_APPROVAL");
    assert_eq!(after.sequence, run.sequence + 1);
    assert_eq!(
        after.entered_at_sequence, run.entered_at_sequence,
        "a reminder does not re-enter the state"
    );
}

#[test]
fn expired_approval_ends_cancelled_with_its_reason() {
    let def = builtin::research_agent();
    let run = run_in(&def, "WAITING_APPROVAL");
    let after = step(
        &def,
        &run,
        "REJECTED",
        json!({"reason": "approval_expired"}),
    );
    assert_eq!(after.state, "CANCELLED");
    assert_eq!(after.terminal_reason.as_deref(), Some("approval_expired"));
}

#[test]
fn decide_prefers_unrecoverable_over_task_ready_and_continue_in_any_order() {
    let def = builtin::research_agent();
    let run = observing_with_result(&def);
    let orders: [[&str; 3]; 6] = [
        ["CONTINUE", "TASK_READY", "UNRECOVERABLE"],
        ["CONTINUE", "UNRECOVERABLE", "TASK_READY"],
        ["TASK_READY", "CONTINUE", "UNRECOVERABLE"],
        ["TASK_READY", "UNRECOVERABLE", "CONTINUE"],
        ["UNRECOVERABLE", "CONTINUE", "TASK_READY"],
        ["UNRECOVERABLE", "TASK_READY", "CONTINUE"],
    ];
    for order in orders {
        let given = candidates(&order);
        let (chosen, after) = decide(&def, &run, &given).expect("one candidate is legal");
        assert_eq!(given[chosen].0, "UNRECOVERABLE", "{order:?}");
        assert_eq!(after.state, "FAILED", "{order:?}");
    }
}

#[test]
fn decide_prefers_task_ready_over_continue_in_both_orders() {
    let def = builtin::research_agent();
    let run = observing_with_result(&def);
    for order in [["CONTINUE", "TASK_READY"], ["TASK_READY", "CONTINUE"]] {
        let given = candidates(&order);
        let (chosen, after) = decide(&def, &run, &given).expect("one candidate is legal");
        assert_eq!(given[chosen].0, "TASK_READY", "{order:?}");
        assert_eq!(after.state, "FINALIZING", "{order:?}");
    }
}

#[test]
fn decide_prefers_blocked_by_user_over_task_ready() {
    let def = builtin::research_agent();
    let run = observing_with_result(&def);
    let given = candidates(&["TASK_READY", "BLOCKED_BY_USER", "CONTINUE"]);
    let (chosen, after) = decide(&def, &run, &given).expect("one candidate is legal");
    assert_eq!(given[chosen].0, "BLOCKED_BY_USER");
    assert_eq!(after.state, "WAITING_USER");
}

#[test]
fn decide_falls_back_to_continue_when_task_ready_guard_fails() {
    let def = builtin::research_agent();
    let mut run = run_in(&def, "OBSERVING");
    run.results.clear();
    for order in [["TASK_READY", "CONTINUE"], ["CONTINUE", "TASK_READY"]] {
        let given = candidates(&order);
        let (chosen, after) = decide(&def, &run, &given).expect("CONTINUE is legal");
        assert_eq!(given[chosen].0, "CONTINUE", "{order:?}");
        assert_eq!(after.state, "ACTING");
    }
}

#[test]
fn decide_reports_every_rejection_when_no_candidate_is_legal() {
    let def = builtin::research_agent();
    let run = run_in(&def, "INTAKE");
    let errs = decide(&def, &run, &candidates(&["CONTINUE", "TASK_READY"]))
        .expect_err("neither is legal in INTAKE");
    assert_eq!(errs.len(), 2);
    assert!(errs.iter().all(|e| e.reason == RejectReason::NotInTable));
}

#[test]
fn cancel_from_every_non_terminal_state_goes_to_cancelled() {
    let def = builtin::research_agent();
    for state in STATES.iter().filter(|s| !TERMINAL.contains(s)) {
        let run = run_in(&def, state);
        let after = step(&def, &run, "CANCEL", json!({}));
        assert_eq!(after.state, "CANCELLED", "from {state}");
        assert_eq!(after.sequence, run.sequence + 1);
        assert_eq!(after.entered_at_sequence, run.sequence + 1);
        let reason = after.terminal_reason.as_deref().unwrap_or_default();
        assert!(reason.starts_with("cancelled"), "from {state}: {reason:?}");
    }
}

#[test]
fn cancel_records_the_given_reason() {
    let def = builtin::research_agent();
    let run = run_in(&def, "ACTING");
    let after = step(&def, &run, "CANCEL", json!({"reason": "user asked"}));
    let reason = after.terminal_reason.expect("terminal reason");
    assert!(reason.starts_with("cancelled"), "{reason}");
    assert!(reason.contains("user asked"), "{reason}");
}

#[test]
fn cancel_on_a_terminal_state_is_rejected() {
    let def = builtin::research_agent();
    for state in TERMINAL {
        let run = run_in(&def, state);
        let err = next(&def, &run, "CANCEL", json!({})).expect_err("already ended");
        assert_eq!(err.reason, RejectReason::Terminal, "{state}");
        assert_eq!(err.state, state);
        assert_eq!(err.event, "CANCEL");
    }
}

#[test]
fn record_events_leave_the_control_state_unchanged_but_advance_the_sequence() {
    let def = builtin::research_agent();
    for state in STATES {
        for event in RECORD_EVENTS {
            let run = run_in(&def, state);
            let after = step(&def, &run, event, json!({"reason": "x"}));
            assert_eq!(after.state, state, "{event} in {state}");
            assert_eq!(after.sequence, run.sequence + 1, "{event} in {state}");
            assert_eq!(after.entered_at_sequence, run.entered_at_sequence);
            assert_eq!(after.attempt, run.attempt);
            assert_eq!(after.results, run.results);
        }
    }
}

#[test]
fn action_dispatched_with_a_call_still_pending_is_rejected() {
    let def = builtin::research_agent();
    let run = acting_with_pending_call(&def);
    let err = next(&def, &run, "ACTION_DISPATCHED", dispatch_payload("c2", 1))
        .expect_err("c1 is pending");
    assert!(
        matches!(err.reason, RejectReason::BadPayload { .. }),
        "{err}"
    );
}

#[test]
fn action_dispatched_without_its_fields_is_a_bad_payload() {
    let def = builtin::research_agent();
    let run = run_in(&def, "ACTING");
    let err = next(&def, &run, "ACTION_DISPATCHED", json!({"call_id": "c1"}))
        .expect_err("missing fields");
    assert!(
        matches!(err.reason, RejectReason::BadPayload { .. }),
        "{err}"
    );
}

#[test]
fn action_dispatched_records_the_pending_call() {
    let def = builtin::research_agent();
    let run = acting_with_pending_call(&def);
    assert_eq!(run.state, "ACTING");
    assert_eq!(run.pending_call(), Some("c1"));
    assert_eq!(run.sequence, 3);
}
