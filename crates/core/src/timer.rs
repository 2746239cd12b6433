//! Timers of parked runs (SPEC S1, M9): when the next one is due and which events it fires.
//! Pure: the caller supplies the jitter sample and the time elapsed by the database clock.
//!
//! Only waiting states have timers. An active state's `timeout` is an execution timeout
//! enforced by the worker running its action; a dead worker is caught by lease expiry.

use crate::definition::{Definition, StateKind};
use crate::state::RunState;

/// The longest `Retry-After` honoured: one hour.
pub const RETRY_AFTER_MS_MAX: u64 = 3_600_000;

/// The next timer of a run, measured from when it entered its current state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timer {
    pub after_ms: u64,
}

/// When the run's next timer is due, or `None` when nothing but an outside event moves it.
pub fn next_timer(def: &Definition, run: &RunState, jitter_sample: f64) -> Option<Timer> {
    let state = def.state(&run.state)?;
    if state.kind != StateKind::Waiting {
        return None;
    }
    let mut due: Option<u64> = None;
    let mut earliest = |ms: u64| due = Some(due.map_or(ms, |d| d.min(ms)));
    if state.backoff.is_some() {
        let policy = def.retry_policy(&run.state);
        let backoff = policy.backoff_ms(run.attempt, jitter_sample);
        // A server that said when to come back (429/503 Retry-After) is not asked sooner
        // (SPEC R2); what it may ask for is capped.
        let asked = run
            .last_error
            .as_ref()
            .and_then(|e| e.get("retry_after_ms"))
            .and_then(serde_json::Value::as_u64)
            .map_or(0, |ms| ms.min(RETRY_AFTER_MS_MAX));
        // A retry R1 already rules out (not retryable, retries used up) is not waited for:
        // the exhausted path is taken at once.
        let retry_ruled_out = policy.decide(run.last_error.as_ref(), run.attempt, None)
            != crate::retry::RetryDecision::Retry;
        earliest(if retry_ruled_out {
            0
        } else {
            backoff.max(asked)
        });
    }
    if let Some(timeout) = &state.timeout {
        earliest(timeout.after_ms);
    }
    if let Some(approval) = &state.approval {
        earliest(approval.expires_after_ms);
        if let (Some(before), Some(_)) = (approval.remind_before_ms, &approval.reminder_event)
            && run.reminders_sent == 0
        {
            earliest(approval.expires_after_ms.saturating_sub(before));
        }
    }
    due.map(|after_ms| Timer { after_ms })
}

/// Every event a timer of `def` can fire (what [`fired_events`] may offer in some run):
/// approvals' expiry and reminder events, waiting states' timeouts, backoffs' due and
/// exhausted events. In name order.
pub fn timer_events(def: &Definition) -> std::collections::BTreeSet<&str> {
    let mut events = std::collections::BTreeSet::new();
    for state in def.states().filter(|s| s.kind == StateKind::Waiting) {
        if let Some(approval) = &state.approval {
            events.insert(approval.expiry_event.as_str());
            events.extend(approval.reminder_event.as_deref());
        }
        if let Some(timeout) = &state.timeout {
            events.insert(timeout.event.as_str());
        }
        if let Some(backoff) = &state.backoff {
            events.insert(backoff.due.as_str());
            events.insert(backoff.exhausted.as_str());
        }
    }
    events
}

/// The first time after `elapsed_ms` (from entering the state) at which the state's timers
/// offer other events than they do at `elapsed_ms`: an approval's reminder or expiry, or a
/// timeout. `None` when time alone changes nothing (a backoff's events are always offered).
/// A timer whose events are all refused need not be looked at again before then unless the
/// run changes.
pub fn next_change_after(def: &Definition, run: &RunState, elapsed_ms: u64) -> Option<u64> {
    let state = def.state(&run.state)?;
    if state.kind != StateKind::Waiting {
        return None;
    }
    let mut offsets = Vec::new();
    if let Some(approval) = &state.approval {
        offsets.push(approval.expires_after_ms);
        if let (Some(before), Some(_)) = (approval.remind_before_ms, &approval.reminder_event)
            && run.reminders_sent == 0
        {
            offsets.push(approval.expires_after_ms.saturating_sub(before));
        }
    }
    if let Some(timeout) = &state.timeout {
        offsets.push(timeout.after_ms);
    }
    offsets.into_iter().filter(|&ms| ms > elapsed_ms).min()
}

/// Candidate events for a timer that fired `elapsed_ms` after the run entered its state,
/// strongest first; the caller commits the first one the reducer accepts. `try_elapsed_ms`
/// is the time since the current action's first try, by the database clock: a backoff's
/// events record it (`retry.elapsed_ms`), and the due event is only offered when R1 allows
/// the retry, else the exhausted event says why not.
pub fn fired_events(
    def: &Definition,
    run: &RunState,
    elapsed_ms: u64,
    try_elapsed_ms: u64,
) -> Vec<(String, serde_json::Value)> {
    let Some(state) = def.state(&run.state) else {
        return Vec::new();
    };
    if state.kind != StateKind::Waiting {
        return Vec::new();
    }
    let mut out = Vec::new();
    if let Some(approval) = &state.approval {
        if elapsed_ms >= approval.expires_after_ms {
            out.push((
                approval.expiry_event.clone(),
                serde_json::json!({ "reason": "approval_expired" }),
            ));
        } else if let (Some(before), Some(reminder)) =
            (approval.remind_before_ms, &approval.reminder_event)
            && run.reminders_sent == 0
            && elapsed_ms >= approval.expires_after_ms.saturating_sub(before)
        {
            out.push((
                reminder.clone(),
                serde_json::json!({ "reason": "approval_reminder" }),
            ));
        }
    }
    if let Some(timeout) = &state.timeout
        && elapsed_ms >= timeout.after_ms
    {
        out.push((
            timeout.event.clone(),
            serde_json::json!({ "reason": "timeout" }),
        ));
    }
    if let Some(backoff) = &state.backoff {
        let retry = serde_json::json!({ "elapsed_ms": try_elapsed_ms });
        let decision = def.retry_policy(&run.state).decide(
            run.last_error.as_ref(),
            run.attempt,
            Some(try_elapsed_ms),
        );
        if decision == crate::retry::RetryDecision::Retry {
            out.push((backoff.due.clone(), serde_json::json!({ "retry": retry })));
        }
        out.push((
            backoff.exhausted.clone(),
            serde_json::json!({ "reason": decision.reason(), "retry": retry }),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_event_a_timer_fires_is_among_the_definitions_timer_events() {
        for (name, _) in crate::builtin::ALL {
            let def = crate::builtin::load(name).unwrap().unwrap();
            let known = timer_events(&def);
            for state in def.states().filter(|s| s.kind == StateKind::Waiting) {
                let mut run = RunState::initial(&def, serde_json::json!({}));
                run.state = state.name.clone();
                for elapsed_ms in [0, 1_000, u64::MAX / 2] {
                    for (event, _) in fired_events(&def, &run, elapsed_ms, elapsed_ms) {
                        assert!(known.contains(event.as_str()), "{name}: {event}");
                    }
                }
            }
        }
        let lifecycle = crate::builtin::lifecycle();
        let events = timer_events(&lifecycle);
        for event in ["retry", "max_retries_exceeded", "timeout"] {
            assert!(events.contains(event), "lifecycle's timers fire {event}");
        }
    }
}
