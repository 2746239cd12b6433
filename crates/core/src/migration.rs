//! Moving runs in flight to another version of their definition (SPEC V1), and starting a
//! fork from a run's state at a sequence (SPEC E6). Both are pure: they take a run's state
//! and definitions and give the event that records the move, or why the run cannot move.
//!
//! A version declares how runs of an older version move to it in `[migration]` (a state map,
//! data transforms and the states that cannot move); Rust code may register closures in
//! [`Migrations`] instead. Both go through [`plan`], so `rein definitions migrate` treats
//! them alike.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::checkpoint::{Checkpoint, Migrations};
use crate::definition::{Definition, StateKind};
use crate::limits;
use crate::spec::name_problem;
use crate::state::RunState;

/// Most entries in each of a migration's maps and lists.
pub const MIGRATION_ENTRIES_MAX: usize = 256;

/// How runs of version `from` move to the version that declares this (`[migration]`).
/// Applied in this order: the state map, then `rename`, `drop` and `default` on the top-level
/// keys of the run's business data.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrationSpec {
    /// The older version whose runs this moves.
    pub from: u32,
    /// Old control state -> new control state. A state not named keeps its name, which must
    /// exist in the new version.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub states: BTreeMap<String, String>,
    /// Old states whose runs stay on the old version (e.g. a step whose meaning changed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_migratable: Vec<String>,
    /// Data key renames, old -> new.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rename: BTreeMap<String, String>,
    /// Data keys removed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drop: Vec<String>,
    /// Values for data keys a run lacks.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub default: BTreeMap<String, Value>,
}

impl MigrationSpec {
    /// What is wrong with this migration as part of `def` (the version declaring it), as
    /// (item, reason) pairs.
    pub fn problems(&self, def_version: u32, states: &BTreeSet<&str>) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut p = |item: String, reason: String| out.push((item, reason));
        if self.from == 0 || self.from >= def_version {
            p(
                "migration.from".into(),
                format!("must name an older version (1..{def_version})"),
            );
        }
        let sizes = [
            ("states", self.states.len()),
            ("not_migratable", self.not_migratable.len()),
            ("rename", self.rename.len()),
            ("drop", self.drop.len()),
            ("default", self.default.len()),
        ];
        for (name, n) in sizes {
            if n > MIGRATION_ENTRIES_MAX {
                p(
                    format!("migration.{name}"),
                    format!("{n} entries; the limit is {MIGRATION_ENTRIES_MAX}"),
                );
            }
        }
        for (old, new) in &self.states {
            let item = format!("migration.states.{old}");
            if let Some(reason) = name_problem(old).or_else(|| name_problem(new)) {
                p(item, reason);
            } else if !states.contains(new.as_str()) {
                p(
                    item,
                    format!("maps to `{new}`, which this version does not declare"),
                );
            }
        }
        for state in &self.not_migratable {
            if let Some(reason) = name_problem(state) {
                p(format!("migration.not_migratable ({state})"), reason);
            }
            if self.states.contains_key(state) {
                p(
                    format!("migration.not_migratable ({state})"),
                    "is also in `states`: a state either moves or stays".into(),
                );
            }
        }
        let mut targets = BTreeSet::new();
        for (old, new) in &self.rename {
            let item = format!("migration.rename.{old}");
            if let Some(reason) = key_problem(old).or_else(|| key_problem(new)) {
                p(item, reason);
            } else if !targets.insert(new.as_str()) {
                p(item, format!("a second key is renamed to `{new}`"));
            } else if self.drop.contains(new) {
                p(item, format!("renames to `{new}`, which `drop` removes"));
            }
        }
        for key in &self.drop {
            if let Some(reason) = key_problem(key) {
                p(format!("migration.drop ({key})"), reason);
            }
        }
        for key in self.default.keys() {
            if let Some(reason) = key_problem(key) {
                p(format!("migration.default.{key}"), reason);
            }
        }
        out
    }

    /// The moved control state and business data of `run`, or why it cannot move.
    pub fn apply(&self, run: &RunState) -> Result<(String, Value), String> {
        if self.not_migratable.contains(&run.state) {
            return Err(format!(
                "state `{}` is declared not migratable by the migration from v{}",
                run.state, self.from
            ));
        }
        let state = self
            .states
            .get(&run.state)
            .cloned()
            .unwrap_or_else(|| run.state.clone());
        let mut data = match &run.data {
            Value::Object(map) => map.clone(),
            other => {
                let mut map = serde_json::Map::new();
                map.insert("input".into(), other.clone());
                map
            }
        };
        for (old, new) in &self.rename {
            if let Some(value) = data.remove(old) {
                data.insert(new.clone(), value);
            }
        }
        for key in &self.drop {
            data.remove(key);
        }
        for (key, value) in &self.default {
            data.entry(key.clone()).or_insert_with(|| value.clone());
        }
        Ok((state, Value::Object(data)))
    }
}

fn key_problem(key: &str) -> Option<String> {
    if key.is_empty() {
        Some("a data key is empty".into())
    } else if key.len() > limits::NAME_LEN_MAX {
        Some(format!(
            "data key is {} bytes; the limit is {}",
            key.len(),
            limits::NAME_LEN_MAX
        ))
    } else {
        None
    }
}

/// Where a run moves and with what data: the content of its DEFINITION_MIGRATED event.
#[derive(Debug, Clone, PartialEq)]
pub struct MigrationPlan {
    pub definition: String,
    pub from_version: u32,
    pub to_version: u32,
    pub from_state: String,
    pub to_state: String,
    pub data: Value,
}

impl MigrationPlan {
    /// The DEFINITION_MIGRATED payload, recording who moved the run and why.
    pub fn payload(&self, by: &str, reason: Option<&str>) -> Value {
        let mut payload = json!({
            "from_version": self.from_version,
            "to_version": self.to_version,
            "from_state": self.from_state,
            "state": self.to_state,
            "data": self.data,
            "by": by,
        });
        if let Some(reason) = reason {
            payload["reason"] = json!(reason);
        }
        payload
    }
}

/// Why a run cannot move now (SPEC V1); [`Unmovable::later`] tells whether it may once it
/// has moved on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unmovable {
    #[error("the run has finished")]
    Terminal,
    #[error("call {0} is in flight; its result must land first")]
    OpenCall(String),
    #[error("the run waits for the branches of a fan-out")]
    OpenFanOut,
    #[error("the run needs an operator (an in-doubt call); resolve it first")]
    NeedsOperator,
    #[error("the run is already on v{0}")]
    AlreadyThere(u32),
    #[error("{0}")]
    Refused(String),
}

impl Unmovable {
    /// A run in this condition may be movable once it has moved on (a result landed).
    pub fn later(&self) -> bool {
        matches!(
            self,
            Unmovable::OpenCall(_) | Unmovable::OpenFanOut | Unmovable::NeedsOperator
        )
    }
}

/// Why `run` cannot be moved or forked as it is: it must be between steps.
pub fn between_steps(run: &RunState) -> Result<(), Unmovable> {
    if run.terminal_reason.is_some() {
        return Err(Unmovable::Terminal);
    }
    if let Some(call) = run.pending_call() {
        return Err(Unmovable::OpenCall(call.to_owned()));
    }
    if run.join.is_some() {
        return Err(Unmovable::OpenFanOut);
    }
    if run.needs_operator {
        return Err(Unmovable::NeedsOperator);
    }
    Ok(())
}

/// Plans moving `run` to `to` with `migrations` (declared and registered steps, chained).
pub fn plan(
    to: &Definition,
    migrations: &Migrations,
    run: &RunState,
) -> Result<MigrationPlan, Unmovable> {
    if run.definition != to.name() {
        return Err(Unmovable::Refused(format!(
            "the run is of `{}`, not `{}`",
            run.definition,
            to.name()
        )));
    }
    if run.version == to.version() {
        return Err(Unmovable::AlreadyThere(run.version));
    }
    between_steps(run)?;
    let moved = migrations
        .migrate(&Checkpoint::of(run), to.version())
        .map_err(|e| Unmovable::Refused(e.to_string()))?;
    let state = moved.state.state;
    match to.state(&state).map(|s| s.kind) {
        None => Err(Unmovable::Refused(format!(
            "state `{state}` does not exist in v{} and the migration does not map it",
            to.version()
        ))),
        Some(StateKind::Terminal) => Err(Unmovable::Refused(format!(
            "state `{state}` is terminal in v{}: a migration does not end runs",
            to.version()
        ))),
        Some(_) => Ok(MigrationPlan {
            definition: run.definition.clone(),
            from_version: run.version,
            to_version: to.version(),
            from_state: run.state.clone(),
            to_state: state,
            data: moved.state.data,
        }),
    }
}

/// The run a fork starts from: the source's state `at` (its replay up to that sequence),
/// moved to `to` when that is another version, with `input_patch` (an object) merged into
/// its data key by key (`null` removes a key). The fork's first event carries it whole.
pub fn fork_snapshot(
    at: &RunState,
    to: &Definition,
    migrations: &Migrations,
    input_patch: Option<&Value>,
) -> Result<RunState, Unmovable> {
    between_steps(at)?;
    let mut snapshot = at.clone();
    if at.definition != to.name() || at.version != to.version() {
        let plan = plan(to, migrations, at)?;
        snapshot.definition = plan.definition;
        snapshot.version = plan.to_version;
        if snapshot.state != plan.to_state {
            snapshot.state = plan.to_state;
            snapshot.attempt = 0;
            snapshot.action = None;
            snapshot.reminders_sent = 0;
        }
        snapshot.data = plan.data;
    }
    if let Some(patch) = input_patch {
        let Value::Object(patch) = patch else {
            return Err(Unmovable::Refused(
                "--input-patch must be a JSON object".into(),
            ));
        };
        if !snapshot.data.is_object() {
            snapshot.data = json!({});
        }
        if let Value::Object(data) = &mut snapshot.data {
            for (k, v) in patch {
                if v.is_null() {
                    data.remove(k);
                } else {
                    data.insert(k.clone(), v.clone());
                }
            }
        }
    }
    Ok(snapshot)
}

/// The RUN_FORKED payload of a fork of `source_run_id` at `at_sequence`.
pub fn fork_payload(
    source_run_id: &str,
    at_sequence: u64,
    source_version: u32,
    snapshot: &RunState,
    by: &str,
) -> Value {
    json!({
        "source_run_id": source_run_id,
        "at_sequence": at_sequence,
        "source_version": source_version,
        "snapshot": snapshot,
        "by": by,
    })
}

/// The version a run's log starts on: the `from_version` of its first DEFINITION_MIGRATED
/// event, or `current` when it was never moved.
pub fn first_version<'e>(current: u32, events: impl IntoIterator<Item = &'e crate::Event>) -> u32 {
    events
        .into_iter()
        .find(|e| e.kind == crate::EngineEvent::DefinitionMigrated.as_str())
        .and_then(|e| e.payload.get("from_version").and_then(Value::as_u64))
        .and_then(|v| u32::try_from(v).ok())
        .unwrap_or(current)
}

/// Every version a run's log is reduced with, in order: the first, then each migration's
/// `to_version`.
pub fn versions_in_log<'e>(
    current: u32,
    events: impl IntoIterator<Item = &'e crate::Event> + Clone,
) -> Vec<u32> {
    let mut out = vec![first_version(current, events.clone())];
    out.extend(
        events
            .into_iter()
            .filter(|e| e.kind == crate::EngineEvent::DefinitionMigrated.as_str())
            .filter_map(|e| e.payload.get("to_version").and_then(Value::as_u64))
            .filter_map(|v| u32::try_from(v).ok()),
    );
    out
}
