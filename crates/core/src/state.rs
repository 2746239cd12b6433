//! The run projection `X = (s, d, v, r, o)` (SPEC M3): control state, business data,
//! definition version, run metadata that the log determines, and the side-effect ledger of
//! the current action. Lease and wall-clock metadata live in storage, not here: they are not
//! a function of the log.

use serde::{Deserialize, Serialize};

use crate::definition::{Definition, StateKind};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    pub definition: String,
    pub version: u32,
    /// Control state `s`.
    pub state: String,
    /// Business data `d`: the run input, merged with `payload.data` of applied events.
    pub data: serde_json::Value,
    /// Retries already made of the current step (0 on the first try).
    pub attempt: u32,
    /// Sequence of the last applied event (0 before the first).
    pub sequence: u64,
    /// Logical actions finished for good; the next new action is step `steps_completed + 1`.
    pub steps_completed: u32,
    /// The current action's ledger entry (`o`), kept after a retryable failure so the retry
    /// reuses its action id and idempotency key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<ActionSlot>,
    #[serde(default)]
    pub results: Vec<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<serde_json::Value>,
    /// Why the run ended (SPEC C11); set on entering a terminal state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminal_reason: Option<String>,
    /// An in-doubt action could not be reconciled automatically (SPEC M9, X7).
    #[serde(default)]
    pub needs_operator: bool,
    /// Sequence of the event that entered the current control state.
    pub entered_at_sequence: u64,
    /// Approval reminders already sent in the current state.
    #[serde(default)]
    pub reminders_sent: u32,
    /// Usage against the definition's budgets; kept only when the definition declares one.
    #[serde(default, skip_serializing_if = "Usage::is_zero")]
    pub usage: Usage,
    /// The open fan-out, while the run waits in a fan-out state for its branches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join: Option<JoinState>,
}

/// Accumulated usage (SPEC budgets): `payload.usage = {tokens, cost}` of applied events, and
/// definition events applied as steps.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub tokens: u64,
    #[serde(default)]
    pub cost: f64,
    #[serde(default)]
    pub steps: u64,
    /// The budget whose event was applied (`tokens`, `cost`, `steps`, `wall_time_ms`): the
    /// budget event fires once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exhausted: Option<String>,
}

impl Usage {
    pub fn is_zero(&self) -> bool {
        *self == Usage::default()
    }
}

/// An open fan-out: its branches' results land in `data.branches.NAME`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinState {
    /// The fan-out state the run waits in.
    pub state: String,
    /// Sequence of the event that entered it; names this fan-out in its children's results.
    pub fan_out: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionSlot {
    pub action_id: String,
    pub node: String,
    pub step: u32,
    pub idempotency_key: String,
    /// The call in flight; `None` once its result arrived (or it was declared not applied).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    pub status: ActionStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action_hash: Option<String>,
    /// Why the call's answer was lost, as its ACTION_RESULT_IN_DOUBT recorded it (the fine
    /// class, e.g. `timeout`): the failure committed if it turns out not applied says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<String>,
}

/// Lifecycle of an action (SPEC M2): PLANNED -> DISPATCHED -> (SUCCEEDED | FAILED | UNKNOWN).
/// A slot is only recorded from DISPATCHED on; a finished step clears it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ActionStatus {
    Dispatched,
    /// Dispatched, result unknown after a crash or a timeout after send.
    InDoubt,
    /// Failed in a way that may be retried; the step stays open.
    Failed,
}

/// Run status (SPEC M9), separate from control state. `leased` is added by storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Runnable,
    Parked,
    NeedsOperator,
    Terminal,
}

impl RunStatus {
    /// Every status, in lifecycle order.
    pub const ALL: [RunStatus; 4] = [
        RunStatus::Runnable,
        RunStatus::Parked,
        RunStatus::NeedsOperator,
        RunStatus::Terminal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Runnable => "runnable",
            RunStatus::Parked => "parked",
            RunStatus::NeedsOperator => "needs_operator",
            RunStatus::Terminal => "terminal",
        }
    }
}

impl RunState {
    /// The state `X_0` of a new run with `input` as its business data.
    pub fn initial(def: &Definition, input: serde_json::Value) -> RunState {
        let data = if input.is_object() {
            input
        } else {
            serde_json::json!({ "input": input })
        };
        RunState {
            definition: def.name().to_owned(),
            version: def.version(),
            state: def.initial_state().to_owned(),
            data,
            attempt: 0,
            sequence: 0,
            steps_completed: 0,
            action: None,
            results: Vec::new(),
            last_error: None,
            terminal_reason: None,
            needs_operator: false,
            entered_at_sequence: 0,
            reminders_sent: 0,
            usage: Usage::default(),
            join: None,
        }
    }

    /// The call in flight, if any: the one a result event must name.
    pub fn pending_call(&self) -> Option<&str> {
        self.action
            .as_ref()
            .filter(|a| matches!(a.status, ActionStatus::Dispatched | ActionStatus::InDoubt))
            .and_then(|a| a.call_id.as_deref())
    }

    pub fn status(&self, def: &Definition) -> RunStatus {
        match def.state(&self.state).map(|s| s.kind) {
            Some(StateKind::Terminal) => RunStatus::Terminal,
            _ if self.needs_operator => RunStatus::NeedsOperator,
            Some(StateKind::Waiting) => RunStatus::Parked,
            _ => RunStatus::Runnable,
        }
    }

    /// The view guards evaluate against (`run.*`).
    pub fn guard_view(&self) -> serde_json::Value {
        serde_json::json!({
            "state": self.state,
            "attempt": self.attempt,
            "sequence": self.sequence,
            "steps_completed": self.steps_completed,
            "results": self.results,
            "pending_call": self.pending_call(),
            "data": self.data,
            "tokens_used": self.usage.tokens,
            "cost_used": self.usage.cost,
            "steps_used": self.usage.steps,
        })
    }
}
