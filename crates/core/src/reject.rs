//! Why the reducer refuses an event: [`InvalidTransition`] and its [`RejectReason`]. The
//! reducer and the rules it calls (budgets, joins) return these; storage and the API report
//! their codes.

use std::fmt;

use serde::Serialize;

use crate::guard::GuardKind;

/// An event the definition (or the engine's own rules) refuses in the run's current state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("invalid transition at sequence {sequence}: {event} in state {state}: {reason}")]
pub struct InvalidTransition {
    pub state: String,
    pub event: String,
    pub sequence: u64,
    pub reason: RejectReason,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "code", rename_all = "snake_case")]
pub enum RejectReason {
    /// The event's sequence is not `last + 1` (SPEC E2).
    OutOfOrder { expected: u64 },
    /// The definition declares no such event.
    UnknownEvent,
    /// Terminal states accept no ordinary event (SPEC M4).
    Terminal,
    /// No transition for this (state, event) pair.
    NotInTable,
    /// A guard of every candidate transition evaluated to false; the first failing guard of
    /// the highest-priority candidate is named.
    GuardFailed { kind: GuardKind, guard: String },
    /// A guard could not be evaluated (fails closed).
    GuardError {
        kind: GuardKind,
        guard: String,
        error: String,
    },
    /// A result for a call other than the pending one (SPEC X5), or none named while one is
    /// pending.
    CallMismatch {
        pending: Option<String>,
        got: Option<String>,
    },
    /// An engine event whose payload lacks what it needs.
    BadPayload { message: String },
    /// A branch result for a fan-out that is no longer open (the join fired), or for a branch
    /// that already has its result (SPEC P1).
    BranchResultRejected { branch: String, why: String },
    /// A retry R1 does not allow: the error is not retryable, the retries are used up, or
    /// the policy's deadline has passed (`why` is the exhausted event's reason).
    RetryRefused { why: String },
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectReason::OutOfOrder { expected } => {
                write!(f, "out of order: expected sequence {expected}")
            }
            RejectReason::UnknownEvent => {
                write!(f, "unknown event: the definition does not declare it")
            }
            RejectReason::Terminal => write!(f, "the run is in a terminal state"),
            RejectReason::NotInTable => write!(f, "no transition for this state and event"),
            RejectReason::GuardFailed { kind, guard } => write!(f, "{kind} guard failed: {guard}"),
            RejectReason::GuardError { kind, guard, error } => {
                write!(f, "{kind} guard could not be evaluated ({guard}): {error}")
            }
            RejectReason::CallMismatch { pending, got } => write!(
                f,
                "result names call {} but the pending call is {}",
                got.as_deref().unwrap_or("(none)"),
                pending.as_deref().unwrap_or("(none)")
            ),
            RejectReason::BadPayload { message } => write!(f, "bad payload: {message}"),
            RejectReason::BranchResultRejected { branch, why } => {
                write!(f, "result of branch `{branch}` rejected: {why}")
            }
            RejectReason::RetryRefused { why } => write!(f, "no retry: {why}"),
        }
    }
}

impl RejectReason {
    pub fn code(&self) -> &'static str {
        match self {
            RejectReason::OutOfOrder { .. } => "out_of_order",
            RejectReason::UnknownEvent => "unknown_event",
            RejectReason::Terminal => "terminal",
            RejectReason::NotInTable => "not_in_table",
            RejectReason::GuardFailed { .. } => "guard_failed",
            RejectReason::GuardError { .. } => "guard_error",
            RejectReason::CallMismatch { .. } => "call_mismatch",
            RejectReason::BadPayload { .. } => "bad_payload",
            RejectReason::BranchResultRejected { .. } => "branch_result_rejected",
            RejectReason::RetryRefused { .. } => "retry_refused",
        }
    }
}
