//! Retry math (SPEC R1, R2). The random source is an argument (`jitter_sample` in [0, 1)),
//! so every function here is deterministic under test.

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
    /// No retry is started once this much time has passed since the step's first try.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// Error classes never retried, besides `fatal` and `in_doubt`.
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

    /// `retry_allowed = retryable(error) AND attempt < max AND elapsed < deadline` (R1).
    pub fn decide(&self, class: &ErrorClass, attempt: u32, elapsed_ms: u64) -> RetryDecision {
        if !class.is_retryable() || self.non_retryable.iter().any(|c| c == class.name()) {
            return RetryDecision::NotRetryable;
        }
        if attempt >= self.max_retries {
            return RetryDecision::Exhausted;
        }
        if self.deadline_ms.is_some_and(|d| elapsed_ms >= d) {
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

/// Error classes of seed 003 §5.
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
