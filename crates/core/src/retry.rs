//! Retry math and the retry decision (SPEC R1, R2). The random source is an argument
//! (`jitter_sample` in [0, 1)) and elapsed time is what an event recorded, so every function
//! here is deterministic under test and on replay.

use serde::{Deserialize, Serialize};

use crate::definition::{Definition, StateKind};
use crate::event::Event;
use crate::state::{RunState, RunStatus};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// Retries allowed after the first try.
    #[serde(default = "RetryPolicy::default_max_retries")]
    pub max_retries: u32,
    #[serde(default = "RetryPolicy::default_initial_interval_ms")]
    pub initial_interval_ms: u64,
    #[serde(default = "RetryPolicy::default_backoff_factor")]
    pub backoff_factor: f64,
    #[serde(default = "RetryPolicy::default_max_interval_ms")]
    pub max_interval_ms: u64,
    /// Fraction of the interval randomised either way, in [0, 1].
    #[serde(default)]
    pub jitter: f64,
    /// No retry is started once this much time has passed since the first try of the
    /// action (by the database clock; see [`starts_first_try`]): the exhausted path is taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// Error classes never retried, besides `fatal` and `in_doubt`: a coarse class
    /// (`transient`) or a fine one (`error.kind`: `timeout`, `network`, `http_429`,
    /// `http_5xx`, ... or a handler's own). Such a failure takes the exhausted path.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub non_retryable: Vec<String>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_retries: Self::default_max_retries(),
            initial_interval_ms: Self::default_initial_interval_ms(),
            backoff_factor: Self::default_backoff_factor(),
            max_interval_ms: Self::default_max_interval_ms(),
            jitter: 0.0,
            deadline_ms: None,
            non_retryable: Vec::new(),
        }
    }
}

/// Hard ceilings on a policy, so a typo cannot park a run for a century.
pub const MAX_RETRIES_CEILING: u32 = 1000;
pub const INTERVAL_MS_CEILING: u64 = 7 * 24 * 3600 * 1000;

impl RetryPolicy {
    fn default_max_retries() -> u32 {
        3
    }
    fn default_initial_interval_ms() -> u64 {
        1000
    }
    fn default_backoff_factor() -> f64 {
        2.0
    }
    fn default_max_interval_ms() -> u64 {
        60_000
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.max_retries > MAX_RETRIES_CEILING {
            return Err(format!(
                "max_retries {} exceeds {MAX_RETRIES_CEILING}",
                self.max_retries
            ));
        }
        if !(self.backoff_factor.is_finite() && self.backoff_factor >= 1.0) {
            return Err(format!(
                "backoff_factor {} must be a number >= 1",
                self.backoff_factor
            ));
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(format!("jitter {} must be within [0, 1]", self.jitter));
        }
        if self.max_interval_ms > INTERVAL_MS_CEILING {
            return Err(format!(
                "max_interval_ms {} exceeds {INTERVAL_MS_CEILING}",
                self.max_interval_ms
            ));
        }
        if self.initial_interval_ms > self.max_interval_ms {
            return Err("initial_interval_ms must not exceed max_interval_ms".into());
        }
        Ok(())
    }

    /// Delay before retry number `attempt + 1` (attempt = retries already made).
    /// Without jitter: `min(max, initial * factor^attempt)`, non-decreasing in `attempt`.
    /// With jitter `j`, the delay is scaled by a factor in `[1 - j, 1 + j)` and clamped to
    /// `[0, max_interval_ms]`.
    pub fn backoff_ms(&self, attempt: u32, jitter_sample: f64) -> u64 {
        let max = self.max_interval_ms as f64;
        let base =
            (self.initial_interval_ms as f64) * self.backoff_factor.powi(attempt.min(1024) as i32);
        let base = if base.is_finite() { base.min(max) } else { max };
        let sample = if jitter_sample.is_finite() {
            jitter_sample.clamp(0.0, 1.0)
        } else {
            0.5
        };
        let scaled = base * (1.0 - self.jitter + 2.0 * self.jitter * sample);
        scaled.clamp(0.0, max) as u64
    }

    /// Whether the error an event recorded (`payload.error`, kept as `run.last_error`) may be
    /// retried at all: its class is neither `fatal` nor `in_doubt`, it does not say
    /// `retryable: false` (a tool declared `retryable = false`), and this policy names
    /// neither its class nor its fine class (`kind`) in `non_retryable`. A failure recorded
    /// without an error is retryable, as it always was.
    pub fn retryable(&self, error: Option<&serde_json::Value>) -> bool {
        let Some(error) = error.and_then(serde_json::Value::as_object) else {
            return true;
        };
        if error.get("retryable") == Some(&serde_json::Value::Bool(false)) {
            return false;
        }
        let named = |field: &str| error.get(field).and_then(serde_json::Value::as_str);
        let (class, kind) = (named("class"), named("kind"));
        if matches!(class, Some("fatal" | "in_doubt")) {
            return false;
        }
        !self
            .non_retryable
            .iter()
            .any(|c| Some(c.as_str()) == class || Some(c.as_str()) == kind)
    }

    /// `retry_allowed = retryable(error) AND attempt < max AND elapsed < deadline` (R1).
    /// `attempt` is the run's count of retries of the step; `elapsed_ms`, the time since the
    /// step's first try by the database clock, as the event that retries records it (`None`:
    /// not measured, the deadline is not judged).
    pub fn decide(
        &self,
        error: Option<&serde_json::Value>,
        attempt: u32,
        elapsed_ms: Option<u64>,
    ) -> RetryDecision {
        if !self.retryable(error) {
            return RetryDecision::NotRetryable;
        }
        if attempt >= self.max_retries {
            return RetryDecision::Exhausted;
        }
        if let (Some(deadline), Some(elapsed)) = (self.deadline_ms, elapsed_ms)
            && elapsed >= deadline
        {
            return RetryDecision::DeadlinePassed;
        }
        RetryDecision::Retry
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    Retry,
    NotRetryable,
    Exhausted,
    DeadlinePassed,
}

impl RetryDecision {
    /// The `reason` an exhausted event records (the run's `terminal_reason` when it ends).
    pub fn reason(self) -> &'static str {
        match self {
            RetryDecision::Retry | RetryDecision::Exhausted => "retries_exhausted",
            RetryDecision::NotRetryable => "not_retryable",
            RetryDecision::DeadlinePassed => "retry_deadline_passed",
        }
    }
}

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

/// The decision against a retry `event` stands for, when it is the `due` event of the run's
/// backoff state and records the retry's inputs (`payload.retry = {elapsed_ms}`, as the
/// scheduler writes it) and R1 does not allow it. A due event recorded without them (logs
/// written before retries were judged here, or an operator's) is not judged, so such logs
/// replay exactly as they did.
pub fn refused_retry(def: &Definition, run: &RunState, event: &Event) -> Option<RetryDecision> {
    let backoff = def.state(&run.state)?.backoff.as_ref()?;
    if backoff.due != event.kind {
        return None;
    }
    let retry = event.payload.get("retry")?.as_object()?;
    let elapsed_ms = retry.get("elapsed_ms").and_then(serde_json::Value::as_u64);
    let decision =
        def.retry_policy(&run.state)
            .decide(run.last_error.as_ref(), run.attempt, elapsed_ms);
    (decision != RetryDecision::Retry).then_some(decision)
}
