//! A retry policy and the decision R1 makes with it (SPEC R1, R2): how many retries, how
//! long between them, and which errors are never retried. Pure data and math; the retry
//! rules that read a run and its definition are in `retry`.

use serde::{Deserialize, Serialize};

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
    /// action (by the database clock; see `retry::starts_first_try`): the exhausted path is taken.
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
