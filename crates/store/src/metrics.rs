//! Prometheus metric names (SPEC O2) and the recording that happens where the facts are
//! known: every commit passes through this crate, so transitions, time in state, finished
//! runs, retries and fenced writes are counted here once for every role. Recording goes to
//! the `metrics` facade; a process that installs no exporter pays almost nothing.
//!
//! `deploy/prometheus/rein.rules.yml` and `deploy/grafana/rein-dashboard.json` use exactly
//! these names.

use metrics::{counter, gauge, histogram};

use crate::commit::CommitRequest;

pub const TRANSITIONS: &str = "rein_transitions_total";
pub const INVALID_TRANSITIONS: &str = "rein_invalid_transitions_total";
pub const FENCED_WRITES: &str = "rein_fenced_writes_total";
pub const LEASE_CLAIMS: &str = "rein_lease_claims_total";
pub const LEASE_RENEWALS: &str = "rein_lease_renewals_total";
pub const LEASES_LOST: &str = "rein_leases_lost_total";
pub const LEASE_EXPIRIES: &str = "rein_lease_expiries_total";
pub const RETRIES: &str = "rein_retries_total";
pub const RUNS_FINISHED: &str = "rein_runs_finished_total";
pub const TIMERS_FIRED: &str = "rein_timers_fired_total";
pub const TIME_IN_STATE: &str = "rein_time_in_state_seconds";
pub const CLAIM_LATENCY: &str = "rein_claim_latency_seconds";
pub const RECOVERY: &str = "rein_recovery_seconds";
pub const ACTIONS_IN_FLIGHT: &str = "rein_actions_in_flight";
pub const DB_POOL_CONNECTIONS: &str = "rein_db_pool_connections";
pub const DB_POOL_MAX: &str = "rein_db_pool_max";
pub const BUILD_INFO: &str = "rein_build_info";
pub const RUNS: &str = "rein_runs";
pub const QUEUE_DEPTH: &str = "rein_queue_depth";
pub const QUEUE_OLDEST_AGE: &str = "rein_queue_oldest_age_seconds";
pub const RUNS_OLDEST_IN_STATE: &str = "rein_runs_oldest_in_state_seconds";
pub const RUNS_RETRYING: &str = "rein_runs_retrying";
pub const APPROVALS_PENDING: &str = "rein_approvals_pending";
pub const APPROVALS_OLDEST_AGE: &str = "rein_approvals_oldest_pending_age_seconds";

/// How a run ended, for [`RUNS_FINISHED`]: its definition's cancel state is `cancelled`; an
/// ending reached by an event that carries an error (a fatal failure, retries exhausted) is
/// `failed`; anything else is `succeeded`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Succeeded,
    Failed,
    Cancelled,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Succeeded => "succeeded",
            Finish::Failed => "failed",
            Finish::Cancelled => "cancelled",
        }
    }
}

/// A commit that landed: its events as transitions, the state it left (with how long the run
/// was in it, by the database clock), its retries and its ending.
pub(crate) fn committed(request: &CommitRequest, left_after_s: Option<f64>) {
    let definition = request.state.definition.clone();
    for e in &request.events {
        counter!(TRANSITIONS, "definition" => definition.clone(), "event" => e.kind.clone())
            .increment(1);
    }
    if let (Some(state), Some(seconds)) = (&request.left_state, left_after_s) {
        histogram!(TIME_IN_STATE, "definition" => definition.clone(), "state" => state.clone())
            .record(seconds.max(0.0));
    }
    if request.retries > 0 {
        counter!(RETRIES, "definition" => definition.clone()).increment(u64::from(request.retries));
    }
    if let Some(finish) = request.finish {
        counter!(RUNS_FINISHED, "definition" => definition, "outcome" => finish.as_str())
            .increment(1);
    }
}

/// A commit refused because the writer's token or lease is no longer current.
pub(crate) fn fenced() {
    counter!(FENCED_WRITES).increment(1);
}

/// An event the definition refuses in the run's state.
pub(crate) fn invalid_transition(definition: &str, event: &str) {
    counter!(INVALID_TRANSITIONS, "definition" => definition.to_owned(), "event" => event.to_owned())
        .increment(1);
}

/// An event refused as an invalid transition before any commit was planned (SPEC O1, O2):
/// sent from outside (the API, `rein send`, an approval) or proposed by a node's reply.
/// Counted in [`INVALID_TRANSITIONS`] and logged at WARN, once, by the process that refused
/// it; `from` says who proposed it.
pub fn transition_refused(
    definition: &str,
    run_id: uuid::Uuid,
    refused: &rein_core::InvalidTransition,
    from: &str,
) {
    invalid_transition(definition, &refused.event);
    tracing::warn!(%run_id, definition, event = %refused.event, state = %refused.state,
        sequence = refused.sequence, reason = %refused.reason, code = refused.reason.code(), from,
        "transition refused");
}

/// The pool of `store` as gauges: connections in use and idle, and its maximum.
pub fn record_pool(store: &crate::Store) {
    let pool = store.pool();
    let size = f64::from(pool.size());
    let idle = pool.num_idle() as f64;
    gauge!(DB_POOL_CONNECTIONS, "state" => "in_use").set((size - idle).max(0.0));
    gauge!(DB_POOL_CONNECTIONS, "state" => "idle").set(idle);
    gauge!(DB_POOL_MAX).set(f64::from(pool.options().get_max_connections()));
}

/// Counts one action in [`ACTIONS_IN_FLIGHT`] for as long as it lives.
pub struct InFlight(());

impl InFlight {
    pub fn start() -> InFlight {
        gauge!(ACTIONS_IN_FLIGHT).increment(1.0);
        InFlight(())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        gauge!(ACTIONS_IN_FLIGHT).decrement(1.0);
    }
}
