//! Prometheus metric names (SPEC O2) and the recording that happens where the facts are
//! known: every commit passes through this crate, so transitions, time in state, finished
//! runs, retries and fenced writes are counted here once for every role. Recording goes to
//! the `metrics` facade; a process that installs no exporter pays almost nothing.
//!
//! `deploy/prometheus/rein.rules.yml` and `deploy/grafana/rein-dashboard.json` use exactly
//! these names.

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use rein_core::labels::LabelValues;

/// The label values this process has recorded: tenant-written names (definitions, states,
/// events, queues) take at most [`rein_core::limits::METRIC_LABEL_VALUES_MAX`] distinct
/// values per label of each family; the rest count as `other`.
static LABELS: LabelValues = LabelValues::new();

/// `value` as label `label` of `family` records it (itself, or `other` once the label is
/// full).
pub fn label(family: &'static str, label: &'static str, value: &str) -> String {
    LABELS.value(family, label, value)
}

pub const TRANSITIONS: &str = "rein_transitions_total";
pub const INVALID_TRANSITIONS: &str = "rein_invalid_transitions_total";
pub const FENCED_WRITES: &str = "rein_fenced_writes_total";
pub const LEASE_CLAIMS: &str = "rein_lease_claims_total";
pub const LEASE_RENEWALS: &str = "rein_lease_renewals_total";
pub const LEASES_LOST: &str = "rein_leases_lost_total";
pub const LEASE_EXPIRIES: &str = "rein_lease_expiries_total";
pub const RETRIES: &str = "rein_retries_total";
/// Fan-outs refused by the bounds on a tree of runs (SPEC Z4); label `reason` =
/// `fan_out_depth_exceeded` or `fan_out_descendants_exceeded`.
pub const FAN_OUTS_REFUSED: &str = "rein_fan_outs_refused_total";
pub const RUNS_FINISHED: &str = "rein_runs_finished_total";
pub const TIMERS_FIRED: &str = "rein_timers_fired_total";
/// Looks at a row the scheduler could not move, so it set the row's next look ahead; label
/// `scan` = `lease`, `deadline`, `timer` or `inbox`.
pub const SCAN_BACKOFFS: &str = "rein_scheduler_backoffs_total";
/// Definitions compiled from their stored rows: each process compiles a version once and
/// keeps it while its hash stands (more means its cache is too small for the versions in use).
pub const DEFINITIONS_COMPILED: &str = "rein_definitions_compiled_total";
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

/// How a run ended, for [`RUNS_FINISHED`]: `cancelled` when a CANCEL ended it; otherwise the
/// `outcome` its terminal state declares. A terminal state that declares none (definitions
/// written before `outcome` existed) counts as `failed` when the ending event carries an
/// error or is a backoff's `exhausted` event, and as `succeeded` otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Succeeded,
    Failed,
    Cancelled,
}

impl Finish {
    /// How a commit that took a run from `base` to the terminal state `end` ended it, where
    /// `last` is the kind and payload of the commit's last event (the one that ended the run:
    /// a terminal state takes no more); `None` when the run does not end with it.
    pub fn of(
        def: &rein_core::Definition,
        base: &str,
        end: &str,
        last: Option<(&str, &serde_json::Value)>,
    ) -> Option<Finish> {
        use rein_core::definition::TerminalOutcome;
        if !def.is_terminal(end) || def.is_terminal(base) {
            return None;
        }
        let (kind, payload) = last?;
        if kind == rein_core::EngineEvent::Cancel.as_str() {
            return Some(Finish::Cancelled);
        }
        Some(match def.state(end).and_then(|s| s.outcome) {
            Some(TerminalOutcome::Succeeded) => Finish::Succeeded,
            Some(TerminalOutcome::Failed) => Finish::Failed,
            None => {
                let exhausted = def
                    .states()
                    .any(|s| s.backoff.as_ref().is_some_and(|b| b.exhausted == kind));
                if payload.get("error").is_some() || exhausted {
                    Finish::Failed
                } else {
                    Finish::Succeeded
                }
            }
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Succeeded => "succeeded",
            Finish::Failed => "failed",
            Finish::Cancelled => "cancelled",
        }
    }
}

/// A commit that landed in a run of `definition`: its events (by kind) as transitions, the
/// state it left with how long the run was in it (by the database clock), its retries and
/// its ending.
pub(crate) fn committed<'a>(
    definition: &str,
    events: impl IntoIterator<Item = &'a str>,
    left: Option<(&str, f64)>,
    retries: u32,
    finish: Option<Finish>,
) {
    for kind in events {
        counter!(TRANSITIONS,
            "definition" => label(TRANSITIONS, "definition", definition),
            "event" => label(TRANSITIONS, "event", kind))
        .increment(1);
    }
    if let Some((state, seconds)) = left {
        histogram!(TIME_IN_STATE,
            "definition" => label(TIME_IN_STATE, "definition", definition),
            "state" => label(TIME_IN_STATE, "state", state))
        .record(seconds.max(0.0));
    }
    if retries > 0 {
        counter!(RETRIES, "definition" => label(RETRIES, "definition", definition))
            .increment(u64::from(retries));
    }
    if let Some(finish) = finish {
        counter!(RUNS_FINISHED,
            "definition" => label(RUNS_FINISHED, "definition", definition),
            "outcome" => finish.as_str())
        .increment(1);
    }
}

/// The help text of every family, shown on `/metrics`. Where a label carries names a
/// definition or a caller chose, the text says how many distinct values it keeps.
pub fn describe() {
    let capped = rein_core::limits::METRIC_LABEL_VALUES_MAX;
    let names = |what: &str| {
        format!("{what}; at most {capped} distinct values per label, later ones count as `other`")
    };
    describe_counter!(
        TRANSITIONS,
        names("Events committed, by definition and event")
    );
    describe_counter!(
        INVALID_TRANSITIONS,
        names("Events refused as invalid transitions, by definition and event")
    );
    describe_counter!(
        FENCED_WRITES,
        "Commits refused because the writer's lease or token was no longer current"
    );
    describe_counter!(LEASE_CLAIMS, "Runs claimed by this worker");
    describe_counter!(LEASE_RENEWALS, "Leases renewed by this worker");
    describe_counter!(LEASES_LOST, "Leases this worker lost before it was done");
    describe_counter!(LEASE_EXPIRIES, "Expired leases the scheduler recovered");
    describe_counter!(RETRIES, names("Retries scheduled, by definition"));
    describe_counter!(
        RUNS_FINISHED,
        names("Runs that reached a terminal state, by definition and outcome")
    );
    describe_counter!(
        TIMERS_FIRED,
        names("Timer events the scheduler fired, by event")
    );
    describe_counter!(
        SCAN_BACKOFFS,
        "Rows the scheduler could not move and looks at later, by scan"
    );
    describe_counter!(
        FAN_OUTS_REFUSED,
        "Fan-outs refused by the bounds on a tree of runs, by reason"
    );
    describe_counter!(
        DEFINITIONS_COMPILED,
        "Definition versions this process compiled from their stored rows"
    );
    describe_histogram!(
        TIME_IN_STATE,
        names("Time a run spent in the state it left, by definition and state")
    );
    describe_histogram!(CLAIM_LATENCY, metrics::Unit::Seconds, "Time a claim took");
    describe_histogram!(
        RECOVERY,
        metrics::Unit::Seconds,
        "Time from a lease's expiry to its recovery"
    );
    describe_gauge!(ACTIONS_IN_FLIGHT, "Actions this worker is running");
    describe_gauge!(
        DB_POOL_CONNECTIONS,
        "Database connections of this process, by state"
    );
    describe_gauge!(DB_POOL_MAX, "Largest database pool of this process");
    describe_gauge!(BUILD_INFO, "Version and role of this process");
    describe_gauge!(RUNS, names("Runs, by definition and status"));
    describe_gauge!(QUEUE_DEPTH, names("Runs waiting to be claimed, by queue"));
    describe_gauge!(
        QUEUE_OLDEST_AGE,
        names("Age of the oldest run waiting to be claimed, by queue")
    );
    describe_gauge!(
        RUNS_OLDEST_IN_STATE,
        names("Longest time a run has been in its state, by definition and status")
    );
    describe_gauge!(
        RUNS_RETRYING,
        names("Runs waiting for a retry, by definition")
    );
    describe_gauge!(
        APPROVALS_PENDING,
        "Approval requests waiting for a decision"
    );
    describe_gauge!(
        APPROVALS_OLDEST_AGE,
        "Age of the oldest approval request waiting for a decision"
    );
}

/// The built-in definitions (SPEC M7): their names, states and events are the label values
/// known before any run.
pub fn builtin_definitions() -> Vec<rein_core::Definition> {
    rein_core::builtin::ALL
        .iter()
        .filter_map(|(name, _)| rein_core::builtin::load(name)?.ok())
        .collect()
}

/// Registers at 0 the families every process that commits records, with the label values
/// known at start: the built-in definitions' events, states and outcomes, the fan-out
/// refusals. So `increase()` sees the first event and a dashboard shows 0 rather than no
/// data. The values go through [`label`], so they take their share of each label's cap.
pub fn register_engine() {
    use rein_core::EngineEvent;
    for def in builtin_definitions() {
        let definition = def.name();
        let d = |family| label(family, "definition", definition);
        let engine = EngineEvent::ALL.iter().map(|e| e.as_str());
        for event in def.events().map(String::as_str).chain(engine) {
            counter!(TRANSITIONS, "definition" => d(TRANSITIONS),
                "event" => label(TRANSITIONS, "event", event))
            .increment(0);
        }
        // What a caller or a node may propose: the definition's events, and CANCEL.
        let proposed = def.events().map(String::as_str);
        for event in proposed.chain([EngineEvent::Cancel.as_str()]) {
            counter!(INVALID_TRANSITIONS, "definition" => d(INVALID_TRANSITIONS),
                "event" => label(INVALID_TRANSITIONS, "event", event))
            .increment(0);
        }
        // A terminal state is never left, so it has no time in state.
        for state in def.states().filter(|s| !def.is_terminal(&s.name)) {
            let _ = histogram!(TIME_IN_STATE, "definition" => d(TIME_IN_STATE),
                "state" => label(TIME_IN_STATE, "state", &state.name));
        }
        counter!(RETRIES, "definition" => d(RETRIES)).increment(0);
        for finish in [Finish::Succeeded, Finish::Failed, Finish::Cancelled] {
            counter!(RUNS_FINISHED, "definition" => d(RUNS_FINISHED),
                "outcome" => finish.as_str())
            .increment(0);
        }
    }
    counter!(FENCED_WRITES).increment(0);
    counter!(DEFINITIONS_COMPILED).increment(0);
    for reason in [
        rein_core::join::DEPTH_EXCEEDED,
        rein_core::join::DESCENDANTS_EXCEEDED,
    ] {
        counter!(FAN_OUTS_REFUSED, "reason" => reason).increment(0);
    }
}

/// The run statuses of [`RUNS`] ([`crate::FleetGauges::runs`]).
pub const RUN_STATUSES: [&str; 5] = [
    "runnable",
    "running",
    "parked",
    "needs_operator",
    "terminal",
];

/// Registers the fleet gauges a scheduler exports at 0, for the built-in definitions in
/// every status and for the `default` queue, so an empty fleet reads 0 rather than no data.
pub fn register_fleet() {
    for def in builtin_definitions() {
        let definition = def.name();
        let d = |family| label(family, "definition", definition);
        for status in RUN_STATUSES {
            gauge!(RUNS, "definition" => d(RUNS), "status" => label(RUNS, "status", status))
                .set(0.0);
            // Only runs still waiting for something have an age worth alerting on.
            if status != "runnable" && status != "terminal" {
                gauge!(RUNS_OLDEST_IN_STATE, "definition" => d(RUNS_OLDEST_IN_STATE),
                    "status" => label(RUNS_OLDEST_IN_STATE, "status", status))
                .set(0.0);
            }
        }
        gauge!(RUNS_RETRYING, "definition" => d(RUNS_RETRYING)).set(0.0);
    }
    let queue = |family| label(family, "queue", "default");
    gauge!(QUEUE_DEPTH, "queue" => queue(QUEUE_DEPTH)).set(0.0);
    gauge!(QUEUE_OLDEST_AGE, "queue" => queue(QUEUE_OLDEST_AGE)).set(0.0);
    gauge!(APPROVALS_PENDING).set(0.0);
    gauge!(APPROVALS_OLDEST_AGE).set(0.0);
}

/// A commit refused because the writer's token or lease is no longer current.
pub(crate) fn fenced() {
    counter!(FENCED_WRITES).increment(1);
}

/// A fan-out the tree's bounds refused: it took its failure path.
pub(crate) fn fan_out_refused(reason: &'static str) {
    counter!(FAN_OUTS_REFUSED, "reason" => reason).increment(1);
}

/// An event the definition refuses in the run's state.
pub(crate) fn invalid_transition(definition: &str, event: &str) {
    counter!(INVALID_TRANSITIONS,
        "definition" => label(INVALID_TRANSITIONS, "definition", definition),
        "event" => label(INVALID_TRANSITIONS, "event", event))
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

#[cfg(test)]
mod tests {
    use rein_core::{Event, RunState, apply};
    use serde_json::json;

    use super::Finish;

    /// How a lifecycle run that took `path` and then `last` (kind, payload) ends.
    fn finish_after(path: &[&str], last: (&str, serde_json::Value)) -> Option<Finish> {
        let def = rein_core::builtin::lifecycle();
        let mut run = RunState::initial(&def, json!({}));
        for kind in path {
            run = apply(&def, &run, &Event::new(run.sequence + 1, *kind, json!({}))).unwrap();
        }
        let end = apply(
            &def,
            &run,
            &Event::new(run.sequence + 1, last.0, last.1.clone()),
        )
        .unwrap();
        Finish::of(&def, &run.state, &end.state, Some((last.0, &last.1)))
    }

    #[test]
    fn a_run_that_ends_in_a_failed_state_failed_even_when_it_is_the_cancel_state() {
        let fatal = ("fatal_error", json!({ "error": { "class": "fatal" } }));
        assert_eq!(finish_after(&["start"], fatal), Some(Finish::Failed));
        let denied = ("approval_denied", json!({}));
        assert_eq!(
            finish_after(&["start", "pause_for_approval"], denied),
            Some(Finish::Failed)
        );
        let done = ("complete", json!({}));
        assert_eq!(finish_after(&["start"], done), Some(Finish::Succeeded));
    }

    #[test]
    fn the_values_registered_at_start_leave_room_for_tenants_names() {
        use super::*;
        register_engine();
        register_fleet();
        let labelled = [
            (TRANSITIONS, "definition"),
            (TRANSITIONS, "event"),
            (INVALID_TRANSITIONS, "event"),
            (TIME_IN_STATE, "state"),
            (RUNS_FINISHED, "definition"),
            (RUNS, "status"),
            (QUEUE_DEPTH, "queue"),
        ];
        for (family, name) in labelled {
            assert_eq!(
                label(family, name, "a-tenants-own-name"),
                "a-tenants-own-name",
                "{family} {name}"
            );
        }
        // The built-in definitions' values were admitted as themselves.
        assert_eq!(label(TRANSITIONS, "event", "complete"), "complete");
        assert_eq!(
            label(TRANSITIONS, "event", "LEASE_EXPIRED"),
            "LEASE_EXPIRED"
        );
        assert_eq!(label(TIME_IN_STATE, "state", "running"), "running");
    }

    #[test]
    fn only_a_cancel_makes_a_run_cancelled() {
        let cancel = ("CANCEL", json!({ "reason": "not needed" }));
        assert_eq!(finish_after(&["start"], cancel), Some(Finish::Cancelled));
    }

    #[test]
    fn a_commit_that_does_not_end_the_run_finishes_nothing() {
        let def = rein_core::builtin::lifecycle();
        let payload = json!({});
        let start = Some(("start", &payload));
        assert_eq!(Finish::of(&def, "planned", "running", start), None);
        assert_eq!(Finish::of(&def, "done", "done", start), None);
    }
}
