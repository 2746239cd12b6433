//! Events: immutable facts (SPEC E1). The reducer needs only type, payload and sequence;
//! ids, tokens and timestamps are storage's business.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub sequence: u64,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default = "empty_object")]
    pub payload: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::json!({})
}

impl Event {
    pub fn new(sequence: u64, kind: impl Into<String>, payload: serde_json::Value) -> Event {
        Event {
            sequence,
            kind: kind.into(),
            payload,
        }
    }
}

/// Engine events (SPEC M8): outside every definition's table and never rejected by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineEvent {
    /// Moves a non-terminal run to the definition's cancel state.
    Cancel,
    /// A side-effecting action is about to run: `{action_id, call_id, node, step,
    /// idempotency_key, tool?, action_hash?}`.
    ActionDispatched,
    /// A dispatched call's outcome is unknown: `{call_id, reason, error?}`; `error` (class
    /// `in_doubt`) names why in its fine class (`kind`, e.g. `timeout`), kept on the slot.
    ActionResultInDoubt,
    /// An in-doubt call was found not applied (reconcile or operator): `{call_id, by}`; the
    /// step stays open and may be dispatched again. A worker's reconcile commits the state's
    /// failure event with it (`rein_core::retry::lost_attempt_event`), so that dispatch is a
    /// counted retry.
    ActionNotApplied,
    /// Nobody can decide an in-doubt call automatically: `{call_id, reason}`.
    OperatorRequired,
    DecisionRejected,
    ApprovalRequested,
    ApprovalReminder,
    ApprovalDecided,
    LeaseExpired,
    InboxExpired,
    /// A branch's child run ended in one of its success states: `{branch, fan_out,
    /// child_run_id, state, reason, result}`. Delivered by storage with the child's end.
    BranchSucceeded,
    /// A branch's child run ended otherwise (same payload).
    BranchFailed,
    /// A branch result that arrived after its join fired (or twice): recorded, not applied.
    BranchRejected,
    /// A fleet-wide limit (SPEC K1) held the state's action back: `{key, limit, wait_ms,
    /// node}`. Changes nothing but the sequence; the run is claimable again after `wait_ms`,
    /// and no retry is counted.
    ActionDeferred,
    /// The run's log reached its ceiling (`max_events`): `{reason: "step_limit",
    /// max_events, state}`. Moves the run to the cancel state; accepted only at a sequence at
    /// or past the ceiling.
    StepLimitReached,
    /// A `model` action's reply (SPEC D1, E5): `{requested_model, model?, prompt: {messages,
    /// sha256, parent, new: [message hashes]}, reply, finish_reason?, usage?}`. Changes
    /// nothing but the sequence and the run's usage; the decision it carried follows.
    ModelReplied,
    /// The run moves to another version of its definition (SPEC V1): `{from_version,
    /// to_version, state, data, by, reason?}`. Reduced with the new version: the control
    /// state and business data become the migrated ones; the log before it replays on the old
    /// version, after it on the new. Written only by `rein definitions migrate`.
    DefinitionMigrated,
    /// The first event of a fork (SPEC E6): `{source_run_id, at_sequence, source_version,
    /// snapshot}`, where `snapshot` is the source's state at `at_sequence` (a state, not a copy
    /// of history). Written only by `rein fork`.
    RunForked,
}

impl EngineEvent {
    pub const ALL: [EngineEvent; 19] = [
        EngineEvent::Cancel,
        EngineEvent::ActionDispatched,
        EngineEvent::ActionResultInDoubt,
        EngineEvent::ActionNotApplied,
        EngineEvent::OperatorRequired,
        EngineEvent::DecisionRejected,
        EngineEvent::ApprovalRequested,
        EngineEvent::ApprovalReminder,
        EngineEvent::ApprovalDecided,
        EngineEvent::LeaseExpired,
        EngineEvent::InboxExpired,
        EngineEvent::BranchSucceeded,
        EngineEvent::BranchFailed,
        EngineEvent::BranchRejected,
        EngineEvent::ActionDeferred,
        EngineEvent::StepLimitReached,
        EngineEvent::ModelReplied,
        EngineEvent::DefinitionMigrated,
        EngineEvent::RunForked,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EngineEvent::Cancel => "CANCEL",
            EngineEvent::ActionDispatched => "ACTION_DISPATCHED",
            EngineEvent::ActionResultInDoubt => "ACTION_RESULT_IN_DOUBT",
            EngineEvent::ActionNotApplied => "ACTION_NOT_APPLIED",
            EngineEvent::OperatorRequired => "OPERATOR_REQUIRED",
            EngineEvent::DecisionRejected => "DECISION_REJECTED",
            EngineEvent::ApprovalRequested => "APPROVAL_REQUESTED",
            EngineEvent::ApprovalReminder => "APPROVAL_REMINDER",
            EngineEvent::ApprovalDecided => "APPROVAL_DECIDED",
            EngineEvent::LeaseExpired => "LEASE_EXPIRED",
            EngineEvent::InboxExpired => "INBOX_EXPIRED",
            EngineEvent::BranchSucceeded => "BRANCH_SUCCEEDED",
            EngineEvent::BranchFailed => "BRANCH_FAILED",
            EngineEvent::BranchRejected => "BRANCH_REJECTED",
            EngineEvent::ActionDeferred => "ACTION_DEFERRED",
            EngineEvent::StepLimitReached => "STEP_LIMIT_REACHED",
            EngineEvent::ModelReplied => "MODEL_REPLIED",
            EngineEvent::DefinitionMigrated => "DEFINITION_MIGRATED",
            EngineEvent::RunForked => "RUN_FORKED",
        }
    }

    pub fn parse(name: &str) -> Option<EngineEvent> {
        EngineEvent::ALL.into_iter().find(|e| e.as_str() == name)
    }

    /// Events only the engine writes: a branch's result comes from its child run's end.
    pub fn is_engine_only(name: &str) -> bool {
        matches!(
            EngineEvent::parse(name),
            Some(
                EngineEvent::BranchSucceeded
                    | EngineEvent::BranchFailed
                    | EngineEvent::BranchRejected
            )
        )
    }

    /// Events only an operation on the whole run writes (`rein definitions migrate`, `rein
    /// fork`), never a sender.
    pub fn is_operation_only(name: &str) -> bool {
        matches!(
            EngineEvent::parse(name),
            Some(EngineEvent::DefinitionMigrated | EngineEvent::RunForked)
        )
    }

    pub fn is_reserved(name: &str) -> bool {
        EngineEvent::parse(name).is_some()
    }
}
