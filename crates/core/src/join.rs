//! Parallel branches and their join (SPEC P1), pure.
//!
//! Entering a fan-out state opens a join ([`JoinState`]) and marks every branch `running` in
//! `data.branches.NAME`; storage starts one child run per branch in the same commit. Each
//! child's end comes back as BRANCH_SUCCEEDED or BRANCH_FAILED (engine events naming the
//! branch and the fan-out); the reducer records it under the branch's own key, so branches
//! never write the same field. [`decided_event`] says when the policy is met (or can no
//! longer be), and the engine then commits the state's joined or failed event. A result for a
//! fan-out that is no longer open, or for a branch already finished, is refused; storage
//! records it as BRANCH_REJECTED instead of applying it. The commit that decides a join also
//! cancels the branches still running ([`losers`]), unless the fan-out keeps them.

use serde_json::{Map, Value, json};
use uuid::Uuid;

use crate::definition::{BranchSpec, Definition, FanOutSpec, JoinPolicy};
use crate::guard::GuardInput;
use crate::hash::sha256_hex;
use crate::reducer::RejectReason;
use crate::state::{JoinState, RunState};

pub const RUNNING: &str = "running";
pub const SUCCEEDED: &str = "succeeded";
pub const FAILED: &str = "failed";

/// A child run to start for a fan-out that a commit opened.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildRun {
    pub run_id: Uuid,
    pub branch: String,
    pub fan_out: u64,
    pub definition: String,
    pub version: Option<u32>,
    pub input: Value,
    pub succeed_on: Vec<String>,
}

/// How the join stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinOutcome {
    Joined,
    Failed,
}

fn fan_out_of<'d>(def: &'d Definition, join: &JoinState) -> Option<&'d FanOutSpec> {
    def.state(&join.state)?.fan_out.as_ref()
}

fn branches_mut(data: &mut Value) -> &mut Map<String, Value> {
    if !data.is_object() {
        *data = json!({});
    }
    let map = data.as_object_mut().expect("made an object above");
    let entry = map.entry("branches").or_insert_with(|| json!({}));
    if !entry.is_object() {
        *entry = json!({});
    }
    entry.as_object_mut().expect("made an object above")
}

/// Called by the reducer when `next` has just entered `state` at `sequence`: closes any join
/// left behind and opens the state's own fan-out.
pub(crate) fn on_enter(def: &Definition, next: &mut RunState, sequence: u64) {
    next.join = None;
    let Some(fan_out) = def.state(&next.state).and_then(|s| s.fan_out.as_ref()) else {
        return;
    };
    next.join = Some(JoinState {
        state: next.state.clone(),
        fan_out: sequence,
    });
    let branches = branches_mut(&mut next.data);
    for b in &fan_out.branches {
        branches.insert(b.name.clone(), json!({ "status": RUNNING }));
    }
}

/// Records a branch's result in `next` (a copy of the run being reduced).
pub(crate) fn record(
    def: &Definition,
    next: &mut RunState,
    payload: &Value,
    succeeded: bool,
) -> Result<(), RejectReason> {
    let branch = payload
        .get("branch")
        .and_then(Value::as_str)
        .ok_or_else(|| RejectReason::BadPayload {
            message: "a branch result needs a string `branch`".into(),
        })?
        .to_owned();
    let fan_out = payload.get("fan_out").and_then(Value::as_u64);
    let refuse = |why: &str| RejectReason::BranchResultRejected {
        branch: branch.clone(),
        why: why.to_owned(),
    };
    let join = next
        .join
        .clone()
        .ok_or_else(|| refuse("no fan-out is open: the join already fired"))?;
    if fan_out != Some(join.fan_out) {
        return Err(refuse("it belongs to an earlier fan-out"));
    }
    let spec = fan_out_of(def, &join).ok_or_else(|| refuse("the state has no fan-out"))?;
    if !spec.branches.iter().any(|b| b.name == branch) {
        return Err(refuse("no such branch in this fan-out"));
    }
    let branches = branches_mut(&mut next.data);
    if branches
        .get(&branch)
        .and_then(|b| b.get("status"))
        .and_then(Value::as_str)
        != Some(RUNNING)
    {
        return Err(refuse("the branch already has its result"));
    }
    branches.insert(
        branch,
        json!({
            "status": if succeeded { SUCCEEDED } else { FAILED },
            "run_id": payload.get("child_run_id"),
            "state": payload.get("state"),
            "reason": payload.get("reason"),
            "result": payload.get("result").cloned().unwrap_or(Value::Null),
        }),
    );
    Ok(())
}

/// Counts of (succeeded, failed, running) over the fan-out's branches.
fn counts(spec: &FanOutSpec, run: &RunState) -> (usize, usize, usize) {
    let mut c = (0, 0, 0);
    for b in &spec.branches {
        match status_of(run, b) {
            Some(SUCCEEDED) => c.0 += 1,
            Some(FAILED) => c.1 += 1,
            _ => c.2 += 1,
        }
    }
    c
}

fn status_of<'r>(run: &'r RunState, b: &BranchSpec) -> Option<&'r str> {
    run.data
        .get("branches")?
        .get(&b.name)?
        .get("status")?
        .as_str()
}

/// Whether the open join is decided. `None` while it waits (or when no join is open).
pub fn outcome(def: &Definition, run: &RunState) -> Option<JoinOutcome> {
    let join = run.join.as_ref().filter(|j| j.state == run.state)?;
    let spec = fan_out_of(def, join)?;
    let (succeeded, failed, running) = counts(spec, run);
    let total = spec.branches.len();
    match spec.join.policy {
        JoinPolicy::All if succeeded == total => Some(JoinOutcome::Joined),
        JoinPolicy::All if failed > 0 => Some(JoinOutcome::Failed),
        JoinPolicy::All => None,
        JoinPolicy::AtLeast => {
            let k = spec.join.k.unwrap_or(total as u32) as usize;
            if succeeded >= k {
                Some(JoinOutcome::Joined)
            } else if succeeded + running < k {
                Some(JoinOutcome::Failed)
            } else {
                None
            }
        }
        JoinPolicy::Guard => {
            let holds = def.join_guard(&join.state).is_some_and(|g| {
                let input = GuardInput {
                    run: run.guard_view(),
                    event: json!({}),
                    payload: &Value::Null,
                    retry: json!({}),
                    constants: serde_json::to_value(def.constants()).unwrap_or_default(),
                    budget: def.budget_view(),
                };
                g.eval(&input) == Ok(true)
            });
            if holds {
                Some(JoinOutcome::Joined)
            } else if running == 0 {
                Some(JoinOutcome::Failed)
            } else {
                None
            }
        }
    }
}

/// The event that fires a decided join, with the names of the branches that succeeded and
/// failed (their results are in `data.branches`).
pub fn decided_event(def: &Definition, run: &RunState) -> Option<(String, Value)> {
    let outcome = outcome(def, run)?;
    let spec = fan_out_of(def, run.join.as_ref()?)?;
    let names = |status: &str| -> Vec<&str> {
        spec.branches
            .iter()
            .filter(|b| status_of(run, b) == Some(status))
            .map(|b| b.name.as_str())
            .collect()
    };
    let (event, reason) = match outcome {
        JoinOutcome::Joined => (&spec.joined_event, "join_policy_met"),
        JoinOutcome::Failed => (&spec.failed_event, "join_policy_cannot_be_met"),
    };
    Some((
        event.clone(),
        json!({
            "reason": reason,
            "fan_out": run.join.as_ref().map(|j| j.fan_out),
            "succeeded": names(SUCCEEDED),
            "failed": names(FAILED),
            "running": names(RUNNING),
        }),
    ))
}

/// The reason of the CANCEL a branch gets when its join is decided without it.
pub const JOIN_DECIDED: &str = "join_decided";

/// The child runs to cancel when `run`'s join is decided now: its branches still running,
/// unless the fan-out says `cancel_losers = false`. Their result can no longer count, and a
/// branch left running would spend for nothing.
pub fn losers(def: &Definition, parent: Uuid, run: &RunState) -> Vec<Uuid> {
    let (Some(_), Some(join)) = (outcome(def, run), run.join.as_ref()) else {
        return Vec::new();
    };
    let Some(spec) = fan_out_of(def, join).filter(|s| s.cancel_losers) else {
        return Vec::new();
    };
    spec.branches
        .iter()
        .filter(|b| status_of(run, b) == Some(RUNNING))
        .map(|b| child_run_id(parent, join.fan_out, &b.name))
        .collect()
}

/// The id of a branch's child run: a function of the parent, the fan-out and the branch, so
/// a commit retried after a lost answer creates nothing twice.
pub fn child_run_id(parent: Uuid, fan_out: u64, branch: &str) -> Uuid {
    let digest = sha256_hex(format!("rein/branch/v1\0{parent}\0{fan_out}\0{branch}").as_bytes());
    let mut bytes = [0u8; 16];
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&digest[2 * i..2 * i + 2], 16).unwrap_or(0);
    }
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

/// The child runs to start when the commit from `base_sequence` to `run` opened a fan-out.
pub fn children(
    def: &Definition,
    parent: Uuid,
    base_sequence: u64,
    run: &RunState,
) -> Vec<ChildRun> {
    let Some(join) = run.join.as_ref().filter(|j| j.fan_out > base_sequence) else {
        return Vec::new();
    };
    let Some(spec) = fan_out_of(def, join) else {
        return Vec::new();
    };
    spec.branches
        .iter()
        .map(|b| {
            let mut input = b.input.clone().unwrap_or_else(|| json!({}));
            if let (Some(map), Some(Value::Object(extra))) = (
                input.as_object_mut(),
                run.data.get("branch_inputs").and_then(|i| i.get(&b.name)),
            ) {
                for (k, v) in extra {
                    map.insert(k.clone(), v.clone());
                }
            }
            ChildRun {
                run_id: child_run_id(parent, join.fan_out, &b.name),
                branch: b.name.clone(),
                fan_out: join.fan_out,
                definition: b.definition.clone(),
                version: b.version,
                input,
                succeed_on: b.succeed_on.clone(),
            }
        })
        .collect()
}
