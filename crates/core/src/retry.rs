//! Retry math and the retry decision (SPEC R1, R2). The random source is an argument
//! (`jitter_sample` in [0, 1)) and elapsed time is what an event recorded, so every function
//! here is deterministic under test and on replay.
//!
//! The policy and its math live in `retry_policy` (a definition's spec holds one) and the
//! reducer's own check of a retry in [`crate::reducer`]; both are re-exported here. This module
//! adds the failures events record and the rules that run the reducer.

use serde::{Deserialize, Serialize};

use crate::definition::{Definition, StateKind};
use crate::event::Event;
pub use crate::reducer::refused_retry;
pub use crate::retry_policy::{
    INTERVAL_MS_CEILING, MAX_RETRIES_CEILING, RetryDecision, RetryPolicy,
};
use crate::state::{RunState, RunStatus};

/// Error classes of seed 003 §5: whether a failure may be retried at all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "class", rename_all = "snake_case")]
pub enum ErrorClass {
    /// Network, timeout before send, 5xx, 429: try again, after `retry_after_ms` if given.
    Transient { retry_after_ms: Option<u64> },
    /// Validation, 4xx, forbidden, corrupt data: never retried.
    Fatal,
    /// The request may or may not have been applied ("response lost"): reconcile first.
    InDoubt,
}

impl ErrorClass {
    pub fn name(&self) -> &'static str {
        match self {
            ErrorClass::Transient { .. } => "transient",
            ErrorClass::Fatal => "fatal",
            ErrorClass::InDoubt => "in_doubt",
        }
    }

    pub fn is_retryable(&self) -> bool {
        matches!(self, ErrorClass::Transient { .. })
    }

    /// Classifies an HTTP status. `retry_after_s` is the parsed `Retry-After` header.
    pub fn from_http_status(status: u16, retry_after_s: Option<u64>) -> Option<ErrorClass> {
        match status {
            200..=299 => None,
            408 | 429 | 500..=599 => Some(ErrorClass::Transient {
                retry_after_ms: retry_after_s.map(|s| s.saturating_mul(1000)),
            }),
            _ => Some(ErrorClass::Fatal),
        }
    }
}

/// Fine error classes (`error.kind`) the engine gives the failures it records; a handler may
/// give its own (any string). A policy's `non_retryable` names these or the coarse classes.
pub mod kind {
    /// No complete answer in time: an execution timeout, an HTTP 408, or a call that timed
    /// out after it was sent.
    pub const TIMEOUT: &str = "timeout";
    /// No connection could be made: nothing was sent.
    pub const NETWORK: &str = "network";
    pub const HTTP_429: &str = "http_429";
    pub const HTTP_5XX: &str = "http_5xx";
    pub const HTTP_4XX: &str = "http_4xx";
    pub const HTTP_3XX: &str = "http_3xx";
    /// A 2xx reply the engine could not accept (not JSON, wrong shape, too large).
    pub const BAD_REPLY: &str = "bad_reply";
    /// The request could not be built or sent at all (e.g. too large).
    pub const BAD_REQUEST: &str = "bad_request";
    /// The answer was lost for another reason (connection reset, cancelled while sent).
    pub const IN_DOUBT: &str = "in_doubt";
    /// The worker running the attempt lost its lease.
    pub const LEASE_EXPIRED: &str = "lease_expired";
    /// The worker's egress policy refused the address a call would reach: nothing was sent.
    pub const EGRESS_REFUSED: &str = "egress_refused";

    /// The fine class of an HTTP status that is not a success.
    pub fn of_http_status(status: u16) -> &'static str {
        match status {
            408 => TIMEOUT,
            429 => HTTP_429,
            500..=599 => HTTP_5XX,
            300..=399 => HTTP_3XX,
            _ => HTTP_4XX,
        }
    }
}

/// A classified failure as an event records it in `payload.error`: `{"class", "kind",
/// "status"?, "message", "retry_after_ms"?}`. Its message is storable text (see
/// [`crate::text::storable`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub class: ErrorClass,
    /// The fine class: one of [`kind`] or a handler's own.
    pub kind: String,
    pub status: Option<u16>,
    pub message: String,
}

impl Failure {
    pub fn new(class: ErrorClass, kind: &str, message: &str) -> Failure {
        Failure {
            class,
            kind: crate::text::storable(kind),
            status: None,
            message: crate::text::storable(message),
        }
    }

    /// A failure that may be retried.
    pub fn transient(kind: &str, message: &str) -> Failure {
        Failure::new(
            ErrorClass::Transient {
                retry_after_ms: None,
            },
            kind,
            message,
        )
    }

    /// A failure that is never retried.
    pub fn fatal(kind: &str, message: &str) -> Failure {
        Failure::new(ErrorClass::Fatal, kind, message)
    }

    /// A call whose outcome is unknown (SPEC X7).
    pub fn in_doubt(kind: &str, message: &str) -> Failure {
        Failure::new(ErrorClass::InDoubt, kind, message)
    }

    /// The failure an HTTP status stands for; `None` for a success.
    pub fn from_http_status(
        status: u16,
        retry_after_s: Option<u64>,
        message: &str,
    ) -> Option<Failure> {
        let class = ErrorClass::from_http_status(status, retry_after_s)?;
        let mut failure = Failure::new(class, kind::of_http_status(status), message);
        failure.status = Some(status);
        Some(failure)
    }

    pub fn with_status(mut self, status: Option<u16>) -> Failure {
        self.status = status;
        self
    }

    pub fn retry_after_ms(&self) -> Option<u64> {
        match self.class {
            ErrorClass::Transient { retry_after_ms } => retry_after_ms,
            _ => None,
        }
    }

    /// The `payload.error` object that records it.
    pub fn to_json(&self) -> serde_json::Value {
        let mut error = serde_json::Map::new();
        error.insert("class".into(), self.class.name().into());
        error.insert("kind".into(), self.kind.clone().into());
        if let Some(status) = self.status {
            error.insert("status".into(), status.into());
        }
        error.insert("message".into(), self.message.clone().into());
        if let Some(ms) = self.retry_after_ms() {
            error.insert("retry_after_ms".into(), ms.into());
        }
        serde_json::Value::Object(error)
    }
}

/// How an attempt of a state's action ended without a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostAttempt {
    /// The worker running it lost its lease with no call pending (SPEC S2).
    LeaseExpired,
    /// Its in-doubt call was found not applied (SPEC X7): dispatching it again is a retry.
    NotApplied,
}

impl LostAttempt {
    pub fn reason(self) -> &'static str {
        match self {
            LostAttempt::LeaseExpired => "lease_expired",
            LostAttempt::NotApplied => "not_applied",
        }
    }
}

/// The failure event the engine commits right after `record` (the LEASE_EXPIRED or
/// ACTION_NOT_APPLIED that records the lost attempt), so the definition's own retry path
/// counts the attempt, waits its backoff and ends on its exhausted path: the state's
/// `on_lease_expired`, or for a call found not applied an `http` node's `transient_event`
/// first. `None` when the state declares none, a call is still pending after `record`, or
/// the definition would not take the event right after `record`.
pub fn lost_attempt_event(
    def: &Definition,
    run: &RunState,
    record: (&str, &serde_json::Value),
    lost: LostAttempt,
    failure: &Failure,
) -> Option<(String, serde_json::Value)> {
    let spec = def.state(&run.state)?;
    if spec.kind != StateKind::Active {
        return None;
    }
    let declared = match lost {
        LostAttempt::LeaseExpired => spec.on_lease_expired.as_ref(),
        LostAttempt::NotApplied => spec
            .http
            .as_ref()
            .map(|h| &h.transient_event)
            .or(spec.on_lease_expired.as_ref()),
    }?;
    let recorded = crate::reducer::apply(
        def,
        run,
        &Event::new(run.sequence + 1, record.0, record.1.clone()),
    )
    .ok()?;
    // A call still pending has its own result to come (or to be reconciled).
    if recorded.pending_call().is_some() {
        return None;
    }
    let payload = serde_json::json!({ "reason": lost.reason(), "error": failure.to_json() });
    let event = Event::new(recorded.sequence + 1, declared.clone(), payload.clone());
    crate::reducer::apply(def, &recorded, &event)
        .is_ok()
        .then(|| (declared.clone(), payload))
}

/// Whether the commit taking the run from `before` to `after` starts the first try of an
/// action: the run is left runnable at attempt 0 in a new state, a new step, or after
/// retries. A policy's `deadline_ms` counts from there (storage keeps when, by the database
/// clock), so waiting for a person or a dependency before the first try does not count.
pub fn starts_first_try(def: &Definition, before: &RunState, after: &RunState) -> bool {
    after.status(def) == RunStatus::Runnable
        && after.attempt == 0
        && (after.state != before.state
            || after.steps_completed != before.steps_completed
            || before.attempt != 0)
}
