//! A retry waits at least as long as the server asked (SPEC R2): the backoff timer honours a
//! `retry_after_ms` recorded with the failure, capped at an hour.

use rein_core::{RunState, apply, builtin, timer};
use serde_json::json;

fn waiting_after(retry_after: Option<u64>) -> RunState {
    let def = builtin::refund_agent();
    let run = RunState::initial(&def, json!({}));
    let mut error = json!({ "class": "transient", "status": 503 });
    if let Some(ms) = retry_after {
        error["retry_after_ms"] = json!(ms);
    }
    let event = rein_core::Event::new(1, "TOOL_RETRYABLE_FAILED", json!({ "error": error }));
    apply(&def, &run, &event).expect("ACTING -> RETRY_WAIT")
}

#[test]
fn the_backoff_timer_waits_for_retry_after_when_it_is_longer() {
    let def = builtin::refund_agent();
    let plain = timer::next_timer(&def, &waiting_after(None), 0.5).expect("a timer");
    assert!(
        plain.after_ms < 1000,
        "the policy's first backoff: {plain:?}"
    );
    let asked = timer::next_timer(&def, &waiting_after(Some(5_000)), 0.5).expect("a timer");
    assert_eq!(asked.after_ms, 5_000, "the server's Retry-After wins");
    let short = timer::next_timer(&def, &waiting_after(Some(1)), 0.5).expect("a timer");
    assert_eq!(
        short, plain,
        "a shorter Retry-After does not cut the backoff"
    );
    let absurd = timer::next_timer(&def, &waiting_after(Some(u64::MAX)), 0.5).expect("a timer");
    assert_eq!(absurd.after_ms, timer::RETRY_AFTER_MS_MAX, "capped");
}
