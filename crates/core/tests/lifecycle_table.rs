//! The `lifecycle` definition's transition table (SPEC M4, M7): all 7 x 12 (state, event)
//! pairs, the retry guard and the reducer's ordering and vocabulary checks.

use rein_core::{Definition, Event, InvalidTransition, RejectReason, RunState, apply, builtin};
use serde_json::json;

const STATES: [&str; 7] = [
    "planned", "running", "paused", "blocked", "retrying", "done", "failed",
];

const EVENTS: [&str; 12] = [
    "start",
    "pause_for_approval",
    "approval_granted",
    "approval_denied",
    "block_on_dependency",
    "dependency_resolved",
    "transient_error",
    "retry",
    "max_retries_exceeded",
    "complete",
    "fatal_error",
    "timeout",
];

/// SPEC M7, hard-coded on purpose: reading it from the definition would prove nothing.
const ACCEPTED: [(&str, &str, &str); 14] = [
    ("planned", "start", "running"),
    ("running", "pause_for_approval", "paused"),
    ("running", "block_on_dependency", "blocked"),
    ("running", "complete", "done"),
    ("running", "fatal_error", "failed"),
    ("running", "transient_error", "retrying"),
    ("paused", "approval_granted", "running"),
    ("paused", "approval_denied", "failed"),
    ("paused", "timeout", "failed"),
    ("blocked", "dependency_resolved", "running"),
    ("blocked", "fatal_error", "failed"),
    ("retrying", "retry", "running"),
    ("retrying", "max_retries_exceeded", "failed"),
    ("retrying", "fatal_error", "failed"),
];

const TERMINAL: [&str; 2] = ["done", "failed"];

fn run_in(def: &Definition, state: &str) -> RunState {
    let mut run = RunState::initial(def, json!({}));
    run.state = state.to_owned();
    run.sequence = 4;
    run.entered_at_sequence = 4;
    run
}

fn fire(def: &Definition, run: &RunState, event: &str) -> Result<RunState, InvalidTransition> {
    apply(def, run, &Event::new(run.sequence + 1, event, json!({})))
}

fn expected_target(state: &str, event: &str) -> Option<&'static str> {
    ACCEPTED
        .iter()
        .find(|(s, e, _)| *s == state && *e == event)
        .map(|(_, _, to)| *to)
}

#[test]
fn lifecycle_declares_exactly_the_seven_states_and_twelve_events() {
    let def = builtin::lifecycle();
    let mut states: Vec<&str> = def.states().map(|s| s.name.as_str()).collect();
    states.sort_unstable();
    let mut expected_states = STATES.to_vec();
    expected_states.sort_unstable();
    assert_eq!(states, expected_states);

    let mut events: Vec<&str> = def.events().map(String::as_str).collect();
    events.sort_unstable();
    let mut expected_events = EVENTS.to_vec();
    expected_events.sort_unstable();
    assert_eq!(events, expected_events);
    assert_eq!(def.initial_state(), "planned");
}

#[test]
fn exactly_the_fourteen_table_pairs_are_accepted_with_their_targets() {
    let def = builtin::lifecycle();
    let mut accepted = 0;
    let mut rejected = 0;
    for state in STATES {
        for event in EVENTS {
            let run = run_in(&def, state);
            let result = fire(&def, &run, event);
            match (expected_target(state, event), result) {
                (Some(to), Ok(next)) => {
                    assert_eq!(next.state, to, "{state} + {event}");
                    assert_eq!(next.sequence, run.sequence + 1, "{state} + {event}");
                    accepted += 1;
                }
                (None, Err(_)) => rejected += 1,
                (Some(to), Err(e)) => panic!("{state} + {event} should go to {to}, got {e}"),
                (None, Ok(next)) => {
                    panic!(
                        "{state} + {event} should be rejected, went to {}",
                        next.state
                    )
                }
            }
        }
    }
    assert_eq!(accepted, 14);
    assert_eq!(rejected, 70);
}

#[test]
fn every_rejected_pair_is_an_invalid_transition_naming_state_event_and_sequence() {
    let def = builtin::lifecycle();
    let mut not_in_table = 0;
    let mut terminal = 0;
    for state in STATES {
        for event in EVENTS {
            if expected_target(state, event).is_some() {
                continue;
            }
            let run = run_in(&def, state);
            let err = fire(&def, &run, event).expect_err("pair is not in the table");
            assert_eq!(err.state, state);
            assert_eq!(err.event, event);
            assert_eq!(err.sequence, run.sequence + 1);
            if TERMINAL.contains(&state) {
                assert_eq!(err.reason, RejectReason::Terminal, "{state} + {event}");
                terminal += 1;
            } else {
                assert_eq!(err.reason, RejectReason::NotInTable, "{state} + {event}");
                not_in_table += 1;
            }
        }
    }
    assert_eq!(terminal, 24);
    assert_eq!(not_in_table, 46);
}

#[test]
fn terminal_state_accepts_no_ordinary_event() {
    let def = builtin::lifecycle();
    for state in TERMINAL {
        assert!(def.is_terminal(state));
        for event in EVENTS {
            let err = fire(&def, &run_in(&def, state), event).expect_err("terminal");
            assert_eq!(err.reason, RejectReason::Terminal, "{state} + {event}");
        }
    }
}

#[test]
fn rejection_leaves_the_input_run_untouched() {
    let def = builtin::lifecycle();
    let run = run_in(&def, "planned");
    let before = run.clone();
    fire(&def, &run, "complete").expect_err("planned + complete is not in the table");
    assert_eq!(run, before);
}

#[test]
fn retry_is_accepted_while_attempt_is_below_max_retries() {
    let def = builtin::lifecycle();
    for attempt in 0..3 {
        let mut run = run_in(&def, "retrying");
        run.attempt = attempt;
        let next = fire(&def, &run, "retry")
            .unwrap_or_else(|e| panic!("retry at attempt {attempt} should pass: {e}"));
        assert_eq!(next.state, "running");
    }
}

#[test]
fn retry_is_rejected_by_its_guard_once_attempts_are_exhausted() {
    let def = builtin::lifecycle();
    let mut run = run_in(&def, "retrying");
    run.attempt = 3;
    let err = fire(&def, &run, "retry").expect_err("attempt 3 of 3");
    assert!(
        matches!(&err.reason, RejectReason::GuardFailed { guard, .. } if guard == "attempts_left"),
        "{err}"
    );
    assert_eq!(err.state, "retrying");
    assert_eq!(err.event, "retry");
}

#[test]
fn retry_increments_attempt() {
    let def = builtin::lifecycle();
    let mut run = run_in(&def, "retrying");
    run.attempt = 1;
    let next = fire(&def, &run, "retry").expect("attempt 1 of 3");
    assert_eq!(next.attempt, 2);
}

#[test]
fn retries_are_counted_across_a_real_retry_loop_until_exhausted() {
    let def = builtin::lifecycle();
    let mut run = fire(&def, &RunState::initial(&def, json!({})), "start").expect("start");
    for expected_attempt in 1..=3 {
        run = fire(&def, &run, "transient_error").expect("transient_error");
        run = fire(&def, &run, "retry").expect("retry with attempts left");
        assert_eq!(run.attempt, expected_attempt);
    }
    run = fire(&def, &run, "transient_error").expect("transient_error");
    assert_eq!(run.state, "retrying");
    let err = fire(&def, &run, "retry").expect_err("exhausted");
    assert!(
        matches!(err.reason, RejectReason::GuardFailed { .. }),
        "{err}"
    );
}

#[test]
fn max_retries_exceeded_leaves_retrying_after_exhaustion() {
    let def = builtin::lifecycle();
    let mut run = run_in(&def, "retrying");
    run.attempt = 3;
    let next = fire(&def, &run, "max_retries_exceeded").expect("exhausted run can fail");
    assert_eq!(next.state, "failed");
    assert_eq!(
        next.terminal_reason.as_deref(),
        Some("max_retries_exceeded")
    );
}

#[test]
fn fatal_error_leaves_retrying_after_exhaustion() {
    let def = builtin::lifecycle();
    let mut run = run_in(&def, "retrying");
    run.attempt = 3;
    let next = fire(&def, &run, "fatal_error").expect("exhausted run can fail");
    assert_eq!(next.state, "failed");
}

#[test]
fn event_the_definition_does_not_declare_is_an_unknown_event() {
    let def = builtin::lifecycle();
    let run = run_in(&def, "running");
    let err = fire(&def, &run, "explode").expect_err("undeclared");
    assert_eq!(err.reason, RejectReason::UnknownEvent);
    assert_eq!(err.state, "running");
    assert_eq!(err.event, "explode");
}

#[test]
fn event_of_another_definition_is_an_unknown_event() {
    let def = builtin::lifecycle();
    let run = run_in(&def, "running");
    let err = fire(&def, &run, "TOOL_SUCCEEDED").expect_err("research-agent event");
    assert_eq!(err.reason, RejectReason::UnknownEvent);
}

#[test]
fn event_with_a_sequence_gap_is_out_of_order() {
    let def = builtin::lifecycle();
    let run = run_in(&def, "planned");
    let event = Event::new(run.sequence + 2, "start", json!({}));
    let err = apply(&def, &run, &event).expect_err("gap");
    assert_eq!(
        err.reason,
        RejectReason::OutOfOrder {
            expected: run.sequence + 1
        }
    );
    assert_eq!(err.sequence, run.sequence + 2);
}

#[test]
fn event_replaying_an_applied_sequence_is_out_of_order() {
    let def = builtin::lifecycle();
    let run = run_in(&def, "planned");
    let event = Event::new(run.sequence, "start", json!({}));
    let err = apply(&def, &run, &event).expect_err("already applied");
    assert_eq!(
        err.reason,
        RejectReason::OutOfOrder {
            expected: run.sequence + 1
        }
    );
}

#[test]
fn sequence_is_checked_before_the_table() {
    let def = builtin::lifecycle();
    let run = run_in(&def, "done");
    let err = apply(&def, &run, &Event::new(1, "start", json!({}))).expect_err("stale");
    assert!(
        matches!(err.reason, RejectReason::OutOfOrder { .. }),
        "{err}"
    );
}

#[test]
fn entering_a_terminal_state_records_its_reason() {
    let def = builtin::lifecycle();
    let run = run_in(&def, "running");
    let event = Event::new(
        run.sequence + 1,
        "fatal_error",
        json!({"reason": "disk on fire"}),
    );
    let next = apply(&def, &run, &event).expect("running + fatal_error");
    assert_eq!(next.terminal_reason.as_deref(), Some("disk on fire"));
    assert_eq!(next.entered_at_sequence, event.sequence);
}
