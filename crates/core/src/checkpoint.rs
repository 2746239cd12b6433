//! Checkpoints (SPEC E4, C10) and explicit state migrations between definition versions
//! (SPEC V1). A checkpoint is only a shortcut: the log is the truth, and a checkpoint is
//! used only when it is bound to the definition version that will reduce the tail.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::definition::Definition;
use crate::event::Event;
use crate::reducer::{InvalidTransition, replay};
use crate::state::RunState;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub sequence: u64,
    pub definition: String,
    pub version: u32,
    pub state: RunState,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RecoveryError {
    #[error(
        "checkpoint is bound to {found_name}@v{found_version} but the run uses {expected_name}@v{expected_version}; migrate it explicitly"
    )]
    VersionMismatch {
        found_name: String,
        found_version: u32,
        expected_name: String,
        expected_version: u32,
    },
    #[error("checkpoint says sequence {checkpoint} but its state is at {state}")]
    Inconsistent { checkpoint: u64, state: u64 },
    #[error("the tail does not continue the checkpoint: {0}")]
    Tail(InvalidTransition),
    #[error("no migration from {definition}@v{from} to v{to}")]
    NoMigration {
        definition: String,
        from: u32,
        to: u32,
    },
    #[error("migration {definition} v{from} -> v{to} failed: {message}")]
    MigrationFailed {
        definition: String,
        from: u32,
        to: u32,
        message: String,
    },
}

impl Checkpoint {
    pub fn of(state: &RunState) -> Checkpoint {
        Checkpoint {
            sequence: state.sequence,
            definition: state.definition.clone(),
            version: state.version,
            state: state.clone(),
        }
    }

    /// State after the checkpoint plus `tail` (events with sequence > checkpoint.sequence),
    /// reduced with `def`, which must be the version the checkpoint is bound to.
    pub fn recover<'e>(
        &self,
        def: &Definition,
        tail: impl IntoIterator<Item = &'e Event>,
    ) -> Result<RunState, RecoveryError> {
        if self.definition != def.name() || self.version != def.version() {
            return Err(RecoveryError::VersionMismatch {
                found_name: self.definition.clone(),
                found_version: self.version,
                expected_name: def.name().to_owned(),
                expected_version: def.version(),
            });
        }
        if self.state.sequence != self.sequence {
            return Err(RecoveryError::Inconsistent {
                checkpoint: self.sequence,
                state: self.state.sequence,
            });
        }
        replay(def, self.state.clone(), tail).map_err(|(_, e)| RecoveryError::Tail(e))
    }
}

impl Checkpoint {
    /// What is wrong with this checkpoint, judged against `logged`, the state the log gives at
    /// its sequence when reduced with `def` (the run's definition): `None` when it is a true
    /// snapshot of it (SPEC E4, C10).
    pub fn disagreement(&self, def: &Definition, logged: &RunState) -> Option<String> {
        let at = self.sequence;
        if self.definition != def.name() || self.version != def.version() {
            return Some(format!(
                "checkpoint at sequence {at} is bound to {}@v{} but the run uses {}@v{}",
                self.definition,
                self.version,
                def.name(),
                def.version()
            ));
        }
        if self.state.sequence != at {
            return Some(format!(
                "checkpoint at sequence {at} holds a state at sequence {}",
                self.state.sequence
            ));
        }
        if logged.sequence != at {
            return Some(format!(
                "checkpoint at sequence {at} is past the log, which ends at {}",
                logged.sequence
            ));
        }
        if self.state == *logged {
            return None;
        }
        let fields = |s: &RunState| match serde_json::to_value(s) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        };
        let (mine, theirs) = (fields(&self.state), fields(logged));
        let mut differ: Vec<&str> = mine
            .keys()
            .chain(theirs.keys())
            .filter(|k| mine.get(*k) != theirs.get(*k))
            .map(String::as_str)
            .collect();
        differ.sort_unstable();
        differ.dedup();
        Some(format!(
            "checkpoint at sequence {at} differs from the state the log gives there (in {})",
            if differ.is_empty() {
                "its numbers".to_owned()
            } else {
                differ.join(", ")
            }
        ))
    }
}

/// Replays `events` from `initial` and judges every checkpoint against the state the log
/// gives at its sequence. Returns the final state and what is wrong with each checkpoint
/// that is not a true snapshot; `Err` (with the 0-based index) when the log itself does not
/// replay.
pub fn replay_judging<'e>(
    def: &Definition,
    initial: RunState,
    events: impl IntoIterator<Item = &'e Event>,
    checkpoints: &[Checkpoint],
) -> Result<(RunState, Vec<String>), (usize, InvalidTransition)> {
    replay_judging_across(&|_| Some(def), initial, events, checkpoints)
}

/// [`replay_judging`] for a log that may move between versions (DEFINITION_MIGRATED): each
/// event is reduced with the version it belongs to, from `def_of`, and each checkpoint is
/// judged against the version it is bound to.
pub fn replay_judging_across<'d, 'e>(
    def_of: &dyn Fn(u32) -> Option<&'d Definition>,
    initial: RunState,
    events: impl IntoIterator<Item = &'e Event>,
    checkpoints: &[Checkpoint],
) -> Result<(RunState, Vec<String>), (usize, InvalidTransition)> {
    let mut pending: Vec<&Checkpoint> = checkpoints.iter().collect();
    pending.sort_by_key(|c| std::cmp::Reverse(c.sequence));
    let mut problems = Vec::new();
    let mut judge = |state: &RunState, pending: &mut Vec<&Checkpoint>| {
        while let Some(c) = pending.last().filter(|c| c.sequence <= state.sequence) {
            match def_of(state.version) {
                Some(def) => problems.extend(c.disagreement(def, state)),
                None => problems.push(format!(
                    "checkpoint at sequence {}: version {} is not known",
                    c.sequence, state.version
                )),
            }
            pending.pop();
        }
    };
    let mut run = initial;
    judge(&run, &mut pending);
    for (i, event) in events.into_iter().enumerate() {
        run = crate::reducer::apply_across(def_of, &run, event)
            .map_err(|e| (i, e))?
            .0;
        judge(&run, &mut pending);
    }
    for c in pending.into_iter().rev() {
        match def_of(run.version) {
            Some(def) => problems.extend(c.disagreement(def, &run)),
            None => problems.push(format!("checkpoint at sequence {}", c.sequence)),
        }
    }
    Ok((run, problems))
}

/// A migration of run state from one version of a definition to the next.
pub type MigrationFn = Arc<dyn Fn(RunState) -> Result<RunState, String> + Send + Sync>;

/// Registered migrations, chained v -> v+1 -> ... as needed. Nothing is ever assumed
/// compatible: a missing step is an error.
#[derive(Clone, Default)]
pub struct Migrations {
    /// (definition, from) -> (to, step).
    steps: HashMap<(String, u32), (u32, MigrationFn)>,
}

impl Migrations {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the migration of `definition` from `from` to `from + 1`.
    pub fn register(
        &mut self,
        definition: &str,
        from: u32,
        f: impl Fn(RunState) -> Result<RunState, String> + Send + Sync + 'static,
    ) -> &mut Self {
        self.register_to(definition, from, from + 1, f)
    }

    /// Registers a migration of `definition` from `from` straight to `to`.
    pub fn register_to(
        &mut self,
        definition: &str,
        from: u32,
        to: u32,
        f: impl Fn(RunState) -> Result<RunState, String> + Send + Sync + 'static,
    ) -> &mut Self {
        self.steps
            .insert((definition.to_owned(), from), (to, Arc::new(f)));
        self
    }

    /// Whether a step starts at `from` for `definition`.
    pub fn has_step(&self, definition: &str, from: u32) -> bool {
        self.steps.contains_key(&(definition.to_owned(), from))
    }

    pub fn migrate(&self, checkpoint: &Checkpoint, to: u32) -> Result<Checkpoint, RecoveryError> {
        let mut state = checkpoint.state.clone();
        let mut version = checkpoint.version;
        while version < to {
            let (next, step) = self
                .steps
                .get(&(checkpoint.definition.clone(), version))
                .filter(|(next, _)| *next > version && *next <= to)
                .ok_or_else(|| RecoveryError::NoMigration {
                    definition: checkpoint.definition.clone(),
                    from: version,
                    to: version + 1,
                })?;
            state = step(state).map_err(|message| RecoveryError::MigrationFailed {
                definition: checkpoint.definition.clone(),
                from: version,
                to: *next,
                message,
            })?;
            version = *next;
            state.version = version;
        }
        if version != to {
            return Err(RecoveryError::NoMigration {
                definition: checkpoint.definition.clone(),
                from: version,
                to,
            });
        }
        Ok(Checkpoint {
            sequence: checkpoint.sequence,
            definition: checkpoint.definition.clone(),
            version,
            state,
        })
    }
}
