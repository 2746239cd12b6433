//! Moving runs in flight to another version of their definition (SPEC V1), and starting a
//! fork from a run's state at a sequence (SPEC E6). Both are pure: they take a run's state
//! and definitions and give the event that records the move, or why the run cannot move.
//!
//! A version declares how runs of an older version move to it in `[migration]` (a state map,
//! data transforms and the states that cannot move); Rust code may register closures in
//! [`Migrations`] instead. Both go through [`plan`], so `rein definitions migrate` treats
//! them alike.

use serde_json::{Value, json};

use crate::checkpoint::{Checkpoint, Migrations};
use crate::definition::{Definition, StateKind};
pub use crate::movable::{Unmovable, between_steps};
pub use crate::spec::MigrationSpec;
use crate::state::RunState;

/// The control state and business data `spec` moves `run` to, or why it cannot move.
pub fn apply_declared(spec: &MigrationSpec, run: &RunState) -> Result<(String, Value), String> {
    if spec.not_migratable.contains(&run.state) {
        return Err(format!(
            "state `{}` is declared not migratable by the migration from v{}",
            run.state, spec.from
        ));
    }
    let state = spec
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
    for (old, new) in &spec.rename {
        if let Some(value) = data.remove(old) {
            data.insert(new.clone(), value);
        }
    }
    for key in &spec.drop {
        data.remove(key);
    }
    for (key, value) in &spec.default {
        data.entry(key.clone()).or_insert_with(|| value.clone());
    }
    Ok((state, Value::Object(data)))
}

/// Registers the migration `def` declares in `[migration]` (from its `from` to its own
/// version) in `migrations`, if it declares one; a step registered before for the same
/// version is replaced.
pub fn declare(migrations: &mut Migrations, def: &Definition) {
    if let Some(spec) = def.spec().migration.clone() {
        migrations.register_to(def.name(), spec.from, def.version(), move |mut run| {
            let (state, data) = apply_declared(&spec, &run)?;
            run.state = state;
            run.data = data;
            Ok(run)
        });
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
        snapshot.data = patched(&snapshot.data, patch);
    }
    Ok(snapshot)
}

/// `value` with `patch`'s top-level keys set (a `null` removes the key): how a fork's
/// `--input-patch` changes both the run's data and the input it is stored with, so what is
/// rebuilt from the input (a model's task message) says what the fork was patched to.
pub fn patched(value: &Value, patch: &serde_json::Map<String, Value>) -> Value {
    let mut out = match value {
        Value::Object(map) => map.clone(),
        _ => serde_json::Map::new(),
    };
    for (k, v) in patch {
        if v.is_null() {
            out.remove(k);
        } else {
            out.insert(k.clone(), v.clone());
        }
    }
    Value::Object(out)
}

/// The RUN_FORKED payload of a fork of `source_run_id` at `at_sequence`, recording who forked
/// it and why. The reducer reads only `snapshot`, so a log with or without `reason` replays
/// the same on every release.
pub fn fork_payload(
    source_run_id: &str,
    at_sequence: u64,
    source_version: u32,
    snapshot: &RunState,
    by: &str,
    reason: Option<&str>,
) -> Value {
    let mut payload = json!({
        "source_run_id": source_run_id,
        "at_sequence": at_sequence,
        "source_version": source_version,
        "snapshot": snapshot,
        "by": by,
    });
    if let Some(reason) = reason {
        payload["reason"] = json!(reason);
    }
    payload
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
