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
//!
//! Trees of fan-outs are bounded (SPEC Z4, [`TreeBounds`]): a definition may fan out into
//! itself, and branch versions resolve when each child starts, so no check at registration
//! sees every recursion. Storage judges each fan-out when a commit would start its children;
//! a refused one takes the fan-out's failure path in the same commit ([`refused_events`]),
//! and a join that fails because of it carries the refusal's reason up to the root.

use serde_json::{Map, Value, json};
use uuid::Uuid;

use crate::definition::{BranchSpec, Definition, FanOutSpec, JoinPolicy};
use crate::guard::GuardInput;
use crate::hash::sha256_hex;
use crate::reject::RejectReason;
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
    // A branch refused by the tree's bounds fails its join for that reason, so the root of
    // a tree that hit a bound ends saying which.
    let refused = spec.branches.iter().find_map(|b| {
        let branch = run.data.get("branches")?.get(&b.name)?;
        let reason = branch.get("reason")?.as_str()?;
        (branch.get("status")?.as_str() == Some(FAILED) && is_refusal_reason(reason))
            .then_some(reason)
    });
    let (event, reason) = match outcome {
        JoinOutcome::Joined => (&spec.joined_event, "join_policy_met"),
        JoinOutcome::Failed => (
            &spec.failed_event,
            refused.unwrap_or("join_policy_cannot_be_met"),
        ),
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

/// A branch to cancel: the parent's child started for `branch` by the fan-out at sequence
/// `fan_out`. Storage finds it by these, not by an id derived again here, so a child keeps
/// being found whatever rule made its id when it started (an older release's included).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loser {
    pub fan_out: u64,
    pub branch: String,
}

/// The branches to cancel when `run`'s join is decided now: those still running, unless the
/// fan-out says `cancel_losers = false`. Their result can no longer count, and a branch left
/// running would spend for nothing.
pub fn losers(def: &Definition, run: &RunState) -> Vec<Loser> {
    let (Some(_), Some(join)) = (outcome(def, run), run.join.as_ref()) else {
        return Vec::new();
    };
    let Some(spec) = fan_out_of(def, join).filter(|s| s.cancel_losers) else {
        return Vec::new();
    };
    spec.branches
        .iter()
        .filter(|b| status_of(run, b) == Some(RUNNING))
        .map(|b| Loser {
            fan_out: join.fan_out,
            branch: b.name.clone(),
        })
        .collect()
}

/// The id of a branch's child run: a function of the parent, the fan-out and the branch, so
/// a commit retried after a lost answer creates nothing twice. It is a UUIDv7 with its
/// parent's 48-bit time prefix, the rest from the hash: a whole tree sorts with its root,
/// by the root's creation time, and falls in the root's range of `run_id` (retention by
/// ranges of run ids, docs/SCALING.md).
pub fn child_run_id(parent: Uuid, fan_out: u64, branch: &str) -> Uuid {
    let digest = sha256_hex(format!("rein/branch/v1\0{parent}\0{fan_out}\0{branch}").as_bytes());
    let mut bytes = [0u8; 16];
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&digest[2 * i..2 * i + 2], 16).unwrap_or(0);
    }
    bytes[..6].copy_from_slice(&parent.as_bytes()[..6]);
    // Version 7 in the high nibble of byte 6, the RFC 9562 variant in byte 8.
    bytes[6] = 0x70 | (bytes[6] & 0x0f);
    bytes[8] = 0x80 | (bytes[8] & 0x3f);
    Uuid::from_bytes(bytes)
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

/// The reason a fan-out is refused when its children would sit deeper than the tree allows.
pub const DEPTH_EXCEEDED: &str = "fan_out_depth_exceeded";
/// The reason a fan-out is refused when its root's tree would hold more runs than it allows.
pub const DESCENDANTS_EXCEEDED: &str = "fan_out_descendants_exceeded";
/// How deep a tree of fan-outs may grow by default: a run enqueued is at depth 0, its
/// branches at 1, and a run at this depth may not fan out.
pub const DEPTH_MAX_DEFAULT: u32 = 4;
/// How many runs a root's tree may start by default, over its whole life.
pub const DESCENDANTS_MAX_DEFAULT: u64 = 1_000;
/// The deepest bound a deployment may configure (`rein worker --fan-out-depth-max`).
pub const DEPTH_MAX_LIMIT: u32 = 32;
/// The largest descendants bound a deployment may configure.
pub const DESCENDANTS_MAX_LIMIT: u64 = 1_000_000;

/// The bounds on a tree of fan-outs (SPEC Z4). A definition may fan out into itself, and
/// branch versions resolve when a run starts, so validation cannot see every recursion: the
/// bound is checked when a commit would start the children.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeBounds {
    /// A run at this depth may not fan out (its children would sit deeper).
    pub depth_max: u32,
    /// Most runs started under one root, over its whole life.
    pub descendants_max: u64,
}

impl Default for TreeBounds {
    fn default() -> TreeBounds {
        TreeBounds {
            depth_max: DEPTH_MAX_DEFAULT,
            descendants_max: DESCENDANTS_MAX_DEFAULT,
        }
    }
}

/// Why a fan-out may not start its children.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The fanning run sits at `depth`; its children would pass `depth_max`.
    Depth { depth: u32, depth_max: u32 },
    /// The root's tree holds `descendants` runs; `branches` more would pass `descendants_max`.
    Descendants {
        descendants: u64,
        branches: u64,
        descendants_max: u64,
    },
}

impl TreeBounds {
    /// Whether a run at `depth`, under a root whose tree already started `descendants`
    /// runs, may start `branches` children.
    pub fn check(&self, depth: u32, descendants: u64, branches: u64) -> Result<(), Refusal> {
        if depth >= self.depth_max {
            return Err(Refusal::Depth {
                depth,
                depth_max: self.depth_max,
            });
        }
        if descendants.saturating_add(branches) > self.descendants_max {
            return Err(Refusal::Descendants {
                descendants,
                branches,
                descendants_max: self.descendants_max,
            });
        }
        Ok(())
    }
}

impl Refusal {
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Depth { .. } => DEPTH_EXCEEDED,
            Refusal::Descendants { .. } => DESCENDANTS_EXCEEDED,
        }
    }

    /// The bound and where the tree stands, for the event that records the refusal.
    fn facts(&self) -> Value {
        match *self {
            Refusal::Depth { depth, depth_max } => {
                json!({ "depth": depth, "depth_max": depth_max })
            }
            Refusal::Descendants {
                descendants,
                branches,
                descendants_max,
            } => json!({
                "descendants": descendants,
                "branches": branches,
                "descendants_max": descendants_max,
            }),
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Depth { depth, depth_max } => write!(
                f,
                "the run sits at depth {depth} of its tree and a tree may be {depth_max} deep"
            ),
            Refusal::Descendants {
                descendants,
                branches,
                descendants_max,
            } => write!(
                f,
                "its root's tree started {descendants} runs; {branches} more would pass the bound of {descendants_max}"
            ),
        }
    }
}

/// Whether `reason` is one a refused fan-out records: a join that fails because a branch
/// was refused so carries the same reason, up to the root.
pub fn is_refusal_reason(reason: &str) -> bool {
    reason == DEPTH_EXCEEDED || reason == DESCENDANTS_EXCEEDED
}

/// The events, in order of preference, that take `run` out of the fan-out it just opened
/// when its children may not start: the fan-out's failed event (every branch recorded as
/// failed with the refusal's reason), or CANCEL with that reason when the definition's
/// guards refuse the failed event. Empty when no fan-out is open.
pub fn refused_events(def: &Definition, run: &RunState, refusal: &Refusal) -> Vec<(String, Value)> {
    let Some(join) = run.join.as_ref().filter(|j| j.state == run.state) else {
        return Vec::new();
    };
    let Some(spec) = fan_out_of(def, join) else {
        return Vec::new();
    };
    let reason = refusal.reason();
    let mut data = run.data.clone();
    let branches = branches_mut(&mut data);
    for b in &spec.branches {
        branches.insert(
            b.name.clone(),
            json!({ "status": FAILED, "reason": reason, "state": Value::Null, "result": Value::Null }),
        );
    }
    let names: Vec<&str> = spec.branches.iter().map(|b| b.name.as_str()).collect();
    vec![
        (
            spec.failed_event.clone(),
            json!({
                "reason": reason,
                "fan_out": join.fan_out,
                "succeeded": [],
                "failed": names,
                "running": [],
                "refused": refusal.facts(),
                "data": { "branches": data.get("branches") },
            }),
        ),
        (
            crate::event::EngineEvent::Cancel.as_str().to_owned(),
            json!({ "reason": reason, "refused": refusal.facts() }),
        ),
    ]
}
