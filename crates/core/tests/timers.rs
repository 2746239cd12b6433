//! When a waiting state's timers next offer other events (SPEC S1): the latest a scheduler
//! may look again at a timer whose events were all refused.

use rein_core::{RunState, builtin, timer};
use serde_json::json;

fn in_state(state: &str, reminders_sent: u32) -> RunState {
    let def = builtin::refund_agent();
    let mut run = RunState::initial(&def, json!({}));
    run.state = state.to_owned();
    run.reminders_sent = reminders_sent;
    run
}

#[test]
fn a_refused_reminder_is_looked_at_again_no_later_than_the_expiry() {
    let def = builtin::refund_agent();
    // expires_after_ms = 3_600_000, remind_before_ms = 600_000
    let waiting = in_state("WAITING_APPROVAL", 0);
    assert_eq!(
        timer::next_change_after(&def, &waiting, 0),
        Some(3_000_000),
        "the reminder comes first"
    );
    assert_eq!(
        timer::next_change_after(&def, &waiting, 3_000_000),
        Some(3_600_000),
        "at the reminder, the expiry is next"
    );
    assert_eq!(timer::next_change_after(&def, &waiting, 3_600_000), None);
    let reminded = in_state("WAITING_APPROVAL", 1);
    assert_eq!(
        timer::next_change_after(&def, &reminded, 0),
        Some(3_600_000),
        "no second reminder"
    );
}

#[test]
fn a_backoff_offers_the_same_events_at_any_time() {
    let def = builtin::refund_agent();
    assert_eq!(
        timer::next_change_after(&def, &in_state("RETRY_WAIT", 0), 0),
        None
    );
    assert_eq!(
        timer::next_change_after(&def, &in_state("ACTING", 0), 0),
        None,
        "an active state has no timers"
    );
}
