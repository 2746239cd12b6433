//! The resume brief (SPEC D3): what a model needs to pick a run up after a restart, built
//! from the run's projection alone (itself the newest checkpoint plus the tail of the log).
//!
//! It names the task, the steps done with their results, the step that is pending and the
//! last error. Large values are replaced by a reference (sha256 and size) so the brief stays
//! small whatever the tools returned; a result already stored as a blob keeps its blob
//! reference. Pure and deterministic: the same state always gives the same brief, byte for
//! byte once written with [`ResumeBrief::to_canonical_json`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::definition::{Definition, StateKind};
use crate::hash::{canonical_json, sha256_hex};
use crate::state::{ActionStatus, RunState, Usage};

/// Largest value (task, result, error) written into a brief inline; larger ones are
/// referenced by hash.
pub const BRIEF_VALUE_BYTES_MAX: usize = 2048;
/// Most completed steps a brief lists (the newest ones); older ones are counted.
pub const BRIEF_STEPS_MAX: usize = 50;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResumeBrief {
    pub definition: String,
    pub version: u32,
    /// Control state and status the run is in.
    pub state: String,
    pub status: String,
    /// Sequence of the last event the brief reflects.
    pub sequence: u64,
    /// The run's `data.task` when it has one, else its business data.
    pub task: BriefValue,
    /// Logical steps finished for good.
    pub steps_completed: u32,
    /// Results of completed steps, oldest first (at most [`BRIEF_STEPS_MAX`]).
    pub steps_done: Vec<DoneStep>,
    /// Older results left out of `steps_done`.
    pub steps_omitted: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<PendingStep>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<BriefValue>,
    /// Why the run ended, when it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminal_reason: Option<String>,
    /// Usage so far, when the definition declares a budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Status of each branch of the open fan-out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branches: Option<BTreeMap<String, String>>,
}

/// A value small enough to show, or a reference to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum BriefValue {
    Reference {
        /// sha256 of the value's canonical JSON.
        sha256: String,
        bytes: usize,
    },
    Inline(Value),
}

impl BriefValue {
    pub fn of(value: &Value) -> BriefValue {
        if let Some(blob) = crate::blob::reference_of(value) {
            return BriefValue::Reference {
                sha256: blob.sha256,
                bytes: blob.bytes,
            };
        }
        let text = canonical_json(value);
        if text.len() > BRIEF_VALUE_BYTES_MAX {
            BriefValue::Reference {
                sha256: sha256_hex(text.as_bytes()),
                bytes: text.len(),
            }
        } else {
            BriefValue::Inline(value.clone())
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DoneStep {
    /// The step number when the result came from a dispatched call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    pub result: BriefValue,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingStep {
    pub step: u32,
    pub node: String,
    /// `not_started`, `dispatched` (its result may still come), `in_doubt` (it may have been
    /// applied: it is reconciled, never blindly repeated), `retrying` (a retry of a failed
    /// attempt) or `waiting` (the run is parked in a waiting state).
    pub status: String,
    pub attempt: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

impl ResumeBrief {
    /// The brief as canonical JSON: sorted keys, no whitespace.
    pub fn to_canonical_json(&self) -> String {
        canonical_json(&serde_json::to_value(self).unwrap_or(Value::Null))
    }
}

/// Builds the brief of `run` under `def`.
pub fn resume_brief(def: &Definition, run: &RunState) -> ResumeBrief {
    let task = run.data.get("task").unwrap_or(&run.data);
    let skip = run.results.len().saturating_sub(BRIEF_STEPS_MAX);
    let steps_done = run.results[skip..]
        .iter()
        .map(|r| DoneStep {
            step: r
                .get("step")
                .and_then(Value::as_u64)
                .and_then(|s| u32::try_from(s).ok()),
            node: r.get("node").and_then(Value::as_str).map(str::to_owned),
            result: BriefValue::of(r.get("value").unwrap_or(&Value::Null)),
        })
        .collect();
    ResumeBrief {
        definition: run.definition.clone(),
        version: run.version,
        state: run.state.clone(),
        status: run.status(def).as_str().to_owned(),
        sequence: run.sequence,
        task: BriefValue::of(task),
        steps_completed: run.steps_completed,
        steps_done,
        steps_omitted: skip,
        pending: pending_step(def, run),
        last_error: run.last_error.as_ref().map(BriefValue::of),
        terminal_reason: run.terminal_reason.clone(),
        usage: def.budget().map(|_| run.usage.clone()),
        branches: run.join.as_ref().map(|_| branch_statuses(run)),
    }
}

fn branch_statuses(run: &RunState) -> BTreeMap<String, String> {
    run.data
        .get("branches")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(name, b)| {
                    let status = b.get("status").and_then(Value::as_str).unwrap_or("unknown");
                    (name.clone(), status.to_owned())
                })
                .collect()
        })
        .unwrap_or_default()
}

fn pending_step(def: &Definition, run: &RunState) -> Option<PendingStep> {
    let kind = def.state(&run.state).map(|s| s.kind)?;
    if kind == StateKind::Terminal {
        return None;
    }
    if let Some(slot) = &run.action {
        let status = match slot.status {
            ActionStatus::Dispatched => "dispatched",
            ActionStatus::InDoubt => "in_doubt",
            ActionStatus::Failed => "retrying",
        };
        return Some(PendingStep {
            step: slot.step,
            node: slot.node.clone(),
            status: status.to_owned(),
            attempt: run.attempt,
            tool: slot.tool.clone(),
            idempotency_key: Some(slot.idempotency_key.clone()),
        });
    }
    Some(PendingStep {
        step: run.steps_completed + 1,
        node: run.state.clone(),
        status: if kind == StateKind::Waiting {
            "waiting"
        } else {
            "not_started"
        }
        .to_owned(),
        attempt: run.attempt,
        tool: None,
        idempotency_key: None,
    })
}
